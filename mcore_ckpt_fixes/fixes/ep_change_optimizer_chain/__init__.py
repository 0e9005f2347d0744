"""ep-change-optimizer-chain: a checkpoint saved under one expert-parallel size resumes its optimizer
under another (the distributed optimizer saved fully_reshardable).

Affected: Megatron-Core 0.17.0-0.19.2 (upstream: not found reported).

Failure prevented: under EP > 1 Megatron chains a dense and an expert optimizer, under EP = 1 one
optimizer holds all; the load hands the saved common state back in the saving chain's shape, so
``load_checkpoint`` stops on every rank: ``KeyError: 'optimizer'`` (EP 2 -> 1) or ``RuntimeError:
Expected 2 entries in state dict, but got 4.`` (EP 1 -> 2), though every tensor was found.

How: ``ChainedOptimizer.load_state_dict`` puts such a mixed state dict into its own chain's shape,
pairing parameter groups by kind (dense or expert). The rest is on the page, doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "ep-change-optimizer-chain"
MODULE = "megatron.core.optimizer.optimizer"
CLASS = "ChainedOptimizer"
FUNCTION = "load_state_dict"

FIX = Fix(
    id=ID,
    summary=(
        "A fully_reshardable checkpoint resumes its optimizer under another expert-parallel size (one optimizer "
        "vs a dense + expert chain: the load stopped with KeyError: 'optimizer' or 'Expected 2 entries')"
    ),
    affected=">=0.17.0,<=0.19.2",
    upstream=("not found reported upstream (NVIDIA/Megatron-LM issues searched for both messages)",),
    targets=(Target(MODULE),),
)
