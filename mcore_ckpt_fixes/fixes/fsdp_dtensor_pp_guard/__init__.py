"""fsdp-dtensor-pp-guard: refuse to resume an ``fsdp_dtensor`` checkpoint with another pipeline
layout, instead of loading the first stage's layers into the later stages.

A guard, not a fix: such a checkpoint names each transformer layer by its index within its pipeline
stage, and nothing maps it to the global layer number on load. Resumed with another pipeline layout,
every later stage loads the first stages' layers; ``load_checkpoint`` returns as if it had resumed
and the run trains on a scrambled model. The guard raises one ``ValueError`` naming both layouts and
the remedy, in Megatron-LM's ``_load_base_checkpoint`` and in Megatron-Bridge's own load.

Upstream: NVIDIA/Megatron-LM#7452 (item 12; open).
Affected: Megatron-LM with ``fsdp_dtensor`` 0.14.0-0.19.2 (wheels 0.17.0-0.19.2); Megatron-Bridge <= 0.6.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "fsdp-dtensor-pp-guard"
MODULE = "megatron.training.checkpointing"

FIX = Fix(
    id=ID,
    summary=(
        "An fsdp_dtensor checkpoint resumed with another pipeline layout is refused with one clear error "
        "(was: later stages silently loaded the first stage's layers)"
    ),
    # Measured on the wheels (megatron.training ships from 0.17.0); a Megatron-LM checkout of 0.14-0.16
    # (fsdp_dtensor exists from 0.14.0) is decided by the probe.
    affected=">=0.17.0,<=0.19.2",
    upstream=("NVIDIA/Megatron-LM#7452 (item 12; open): fsdp_dtensor keys use stage-local layer numbers",),
    targets=(
        Target(MODULE),
        # Megatron-Bridge's own fsdp_dtensor save and load (the same stage-local keys; its load reads
        # the checkpoint's run_config.yaml first and compares (TP, PP) only for the RNG state).
        Target(
            "megatron.bridge.training.checkpointing",
            alias_sites=("megatron.bridge.training.setup",),
            package="megatron-bridge",
            affected="<=0.6.2",
        ),
    ),
)
