"""fsdp-dtensor-pp-guard: refuse to resume an ``fsdp_dtensor`` checkpoint with another pipeline
layout, instead of loading the first stage's layers into the later stages.

Affected: Megatron-LM with ``--ckpt-format fsdp_dtensor`` from 0.14.0 (``megatron.training`` ships in
the Megatron-Core wheel from 0.17.0) through 0.19.2; NVIDIA/Megatron-LM#7452 (item 12), open. A guard,
not a fix: such a checkpoint names each transformer layer by its index within its pipeline stage
(``decoder.layers.0`` on every stage: the Megatron-FSDP adapter saves the plain ``state_dict``), and
nothing maps it to the global layer number on load. A resume with another pipeline-parallel size
(or virtual pipeline size, or first/last stage layer counts) loads, on every later stage, the layers
the checkpoint holds under that stage-local name: those of the first stages. ``load_checkpoint``
returns as if it had resumed; the run trains on a scrambled model, and its next checkpoint keeps it.

How (runtime/core.py): ``_load_base_checkpoint``, once it has read a ``fsdp_dtensor`` checkpoint's
arguments, compares their pipeline layout with the run's and raises one ``ValueError`` line naming
both layouts and the remedy. From 0.19 the arguments are read first, on their own (before any tensor
is); 0.17 and 0.18 read them with the tensors, so there the refusal comes once the load has read
them, before ``load_checkpoint`` returns (training never starts on the wrong layers). No byte is read
that the release does not read. ``--use-checkpoint-args`` (the run takes the checkpoint's layout) and
every other format are left alone.

Megatron-Bridge (runtime/bridge.py, up to 0.6.2): its own fsdp_dtensor save and load keep the same
stage-local names; the guard refuses in ``_load_checkpoint_from_path`` as soon as the release has read
the checkpoint's ``run_config.yaml`` (before the DCP metadata or any tensor), comparing the model
config's pipeline layout fields.
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
        Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),
        # Megatron-Bridge's own fsdp_dtensor save and load (the same stage-local keys; its load reads
        # the checkpoint's run_config.yaml first and compares (TP, PP) only for the RNG state).
        Target(
            "megatron.bridge.training.checkpointing",
            f"{__name__}.runtime.bridge:probe",
            f"{__name__}.runtime.bridge:apply",
            alias_sites=("megatron.bridge.training.setup",),
            package="megatron-bridge",
            affected="<=0.6.2",
        ),
    ),
)
