"""rng-under-ep: every rank saves and restores its own RNG state in ``torch_dist`` checkpoints.

Affected: Megatron-Core 0.17.0 - 0.19.2 (``megatron/training`` ships in the wheel from 0.17.0). Fixed
only on upstream main (NVIDIA/Megatron-LM PR #6858, "restore each rank's own RNG state on checkpoint
load"; Megatron-Bridge followed with the same per-rank layout, NVIDIA-NeMo/Megatron-Bridge #5988).

Failure prevented: ``megatron.training.checkpointing.get_rng_state`` describes the ``torch_dist`` RNG
state as ``ShardedObject('rng_state', ..., (pp_size, tp_size), (pp_rank, tp_rank),
replica_id=dp_cp_rank)``: the data-parallel ranks of one (pp, tp) are declared replicas, so only one
of them writes and all of them restore its copy. They are not replicas: the expert-parallel RNG
tracker stream is seeded per EP rank (``seed + 1024 + 100 * ep_rank + etp_rank``) and EP lives inside
the data-parallel group. After a resume every EP rank > 0 draws the MoE router noise and expert
dropout of another rank (and Python / NumPy / torch / CUDA RNG state of that rank too).

How:

* save: ``get_rng_state`` (wrapped; the original still gathers the data-parallel states when
  ``--data-parallel-random-init`` asks for it) returns the same object laid out per rank:
  global shape ``(pp_size, tp_size, dp_cp_size)``, offset ``(pp_rank, tp_rank, dp_cp_rank)``,
  ``replica_id=0``. (pp, tp, dp_cp) names every rank of the dense grid exactly once, so every rank
  writes its own shard. This is the layout upstream main writes and reads, so a checkpoint saved
  with this fix loads on the first upstream release that has it.
* load: ``_load_global_dist_base_checkpoint`` (wrapped) looks at the shards the checkpoint holds for
  the RNG key before loading, and asks for what is there:

  - the per-rank layout: this rank's shard (also after a data-parallel resize, while the rank's
    dp_cp index exists in the checkpoint; a rank beyond it keeps its current RNG state, with a
    ``MegatronPatchWarning``);
  - the old 2-D ``(pp, tp)`` layout written by an unfixed release: the one copy of this (pp, tp),
    which is the best state there is (this rank's own only on dp_cp rank 0, or with
    ``--data-parallel-random-init``, whose list holds every data-parallel rank's state), with a
    ``MegatronPatchWarning`` that names the old layout on every rank whose restored state is not
    its own; a rank that gets its own state back logs the same text instead (INFO on global rank
    0, DEBUG elsewhere). Never silently.

An unfixed release cannot read the RNG state of a checkpoint written with this fix: the shard shape
is part of the stored key (``rng_state/shard_0.0.1_1.1.2``) and it asks for ``rng_state/shard_0.0_1.1``.
It stops in ``load_checkpoint``; ``--no-load-rng`` (or applying this fix) gets past it.

``fsdp_dtensor`` (Megatron-FSDP users' format; :mod:`.runtime.fsdp_dtensor`): the release keys its plain RNG
entry by ``(pp, tp)`` too, and DCP keeps one copy of each leaf of it, written by different ranks:
every rank of a (pp, tp) resumes on a mix. With the fix every rank also saves its own entry under
``(pp, tp, dp_cp)`` (the release's entry is kept, so an unfixed release reads a fixed checkpoint as
its own), and a load restores it, or the shared copy with a warning where the checkpoint has none
(older layout), deciding from the metadata DCP reads anyway. The ``torch_dcp`` entry (a plain list,
no parallel layout) is left as the release writes it. The source diffs cover ``torch_dist`` only.

ms-swift (``swift.megatron.utils.megatron_lm_utils``, gated by ms-swift <= 4.6.0 whatever
Megatron-Core it runs on; :mod:`.runtime.ms_swift`) keeps its own copy of the bug: ``_get_rng_state`` writes
the same 2-D torch_dist object (and ``megatron_fsdp_checkpoint.build_rng_state`` the same "(pp, tp)"
entry). The fix wraps ``_get_rng_state`` (per-rank layout), its module's ``dist_checkpointing.load``
(the layout the checkpoint has, the old one with a warning) and, for fsdp_dtensor, its planner and
``select_rng_state``; the same layouts as above, so checkpoints move between ms-swift and Megatron-LM.

Megatron-Bridge (``megatron.bridge.training.checkpointing``, gated by megatron-bridge <= 0.6.2;
:mod:`.runtime.bridge`) keeps its own ``get_rng_state``: its torch_dist branch is per rank under EP already
(``(pp, tp, dp_cp)``, ``replica_id=0``), its fsdp_dtensor entry is keyed "(pp, tp)" as above. The fix
wraps ``get_rng_state`` (this rank's own "(pp, tp, dp_cp)" entry beside the release's) and
``load_fsdp_dtensor_checkpoint`` (asks for that entry where the checkpoint's metadata has it, hands it
to ``load_checkpoint`` under the key it reads; the shared copy with a warning otherwise).

verl (``verl.utils.checkpoint.megatron_checkpoint_manager``, gated by verl <= 0.9.1 whatever
Megatron-Core it runs on; :mod:`.runtime.verl`) keeps its own copy: ``MegatronCheckpointManager.get_rng_state``
writes the same 2-D torch_dist object into ``extra/dist_ckpt`` and the same "(pp, tp)" entry for
Megatron-FSDP. The fix wraps that method (per-rank layout; this rank's own "(pp, tp, dp_cp)" entry),
the manager module's ``load_dist_checkpointing`` (the layout the checkpoint has, the old one with a
warning), ``_load_megatron_fsdp_checkpoint`` (asks for the own entry only where the checkpoint's
metadata has it) and ``load_rng_states`` (restores it, or the shared copy with a warning).
"""

from ...engine.fix import Fix, Target

ID = "rng-under-ep"
MODULE = "megatron.training.checkpointing"

FIX = Fix(
    id=ID,
    summary="torch_dist RNG state is saved and restored per (pp, tp, dp_cp) rank: EP ranks > 0 keep their own streams",
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM PR #6858 (upstream main only): each rank restores its own RNG state",
        "NVIDIA-NeMo/Megatron-Bridge #5988: the same per-rank (pp, tp, dp_cp) RNG layout in Bridge",
    ),
    targets=(
        Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),
        Target(
            "swift.megatron.utils.megatron_lm_utils",
            f"{__name__}.runtime.ms_swift:probe",
            f"{__name__}.runtime.ms_swift:apply",
            package="ms-swift",
            affected="<=4.6.0",
        ),
        Target(
            "megatron.bridge.training.checkpointing",
            f"{__name__}.runtime.bridge:probe",
            f"{__name__}.runtime.bridge:apply",
            package="megatron-bridge",
            affected="<=0.6.2",
        ),
        Target(
            "verl.utils.checkpoint.megatron_checkpoint_manager",
            f"{__name__}.runtime.verl:probe",
            f"{__name__}.runtime.verl:apply",
            package="verl",
            affected="<=0.9.1",
        ),
    ),
)
