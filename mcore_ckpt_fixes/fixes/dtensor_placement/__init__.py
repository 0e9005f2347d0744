"""dtensor-placement: describe a DTensor parameter to dist_checkpointing from its own mesh and placements.

Affected: Megatron-Core 0.12.0 - 0.19.2 (still upstream). This is the ``dist_checkpointing`` half of
an expert-parallel placement bug whose ``fsdp_dtensor`` half is expert-keys: a DTensor's checkpoint
description taken from a mesh other than its own, so that under EP a rank writes or reads another
rank's expert shard.

Failure prevented: ``make_tp_sharded_tensor_for_checkpoint`` and ``make_sharded_tensor_for_checkpoint``
(``megatron/core/utils.py``) describe a DTensor parameter (torch FSDP2 ``fully_shard``, HSDP, a
library's own expert mesh) with offsets ``(dp_rank, dp_size)`` of the *dense* data-parallel group
they are handed, whatever the DTensor's mesh and placements say. An expert weight sharded over the
expert-data-parallel mesh under EP gets dense-DP offsets and a global shape ``dp_size`` times its
real size, so the save fails validation (``Invalid access pattern``); an HSDP (Replicate, Shard)
parameter is written as ``dp_size`` chunks where there are ``shard`` of them (a wrong global shape on
disk: any other layout then fails or reads the wrong rows); uneven shards get per-rank global shapes.
``SequentialMLP.sharded_state_dict`` then overwrites every expert tensor's DP replica index with the
expert-DP rank, so even a correct description of an expert shard would leave every expert-DP rank
but the first unwritten.

How: for a DTensor the release's helper treats as one (0.16-0.18: every DTensor; 0.19: those that
Megatron's FSDP2 wrapper tagged ``is_torch_fsdp2_param``; decided by running the release's helper, see
:func:`.runtime.core._tag_required`), the replacement computes the shard's global offset per dimension from the
mesh coordinate and the placements (torch's chunking: ``ceil(n / mesh_size)`` rows per shard, the last
ones shorter or empty), merges it with the TP offset when TP splits the same axis (TP outer, the
DTensor inside the TP-local tensor, as FSDP2 shards Megatron's TP-local parameters), takes the
replica index from the Replicate mesh dimensions (the DTensor's mesh holds every copy of its data,
so the dense group the caller passes never decides who writes: on a size-1 mesh this rank is the
main replica), and builds the ShardedTensor on the local tensor:
a regular grid when every split is even, an irregular one (``axis_fragmentations=None``, which
dist_checkpointing supports on PyTorch >= 2.6) otherwise. All-Replicate DTensors (and those on a
size-1 mesh) take the release's plain path with their local tensor and the mesh's replica index:
nothing is gathered. Partial and strided placements are refused
with one line naming the key and the accepted placements. Nothing here issues a collective.

The helpers are bound by name in many modules (``from megatron.core.utils import ...``): they are
replaced with ``replace_function``, which rebinds every loaded module's binding by identity; modules
imported later bind the replacement from ``megatron.core.utils`` itself.

Layout: ``runtime/core.py`` holds the probes, the monkeypatch's own layout computation
(``dtensor_layout``) and the replacements; ``diff/core.py`` the code ``patches/dtensor-placement/``
carries (the helper ``_dtensor_shard_for_checkpoint`` as the release's own ``megatron/core/utils.py``
would have it) and its source edits per release; ``checks/`` the round trips (``scenarios.py``,
``core.py``).
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "dtensor-placement"
UTILS = "megatron.core.utils"
EXPERTS = "megatron.core.transformer.moe.experts"

FIX = Fix(
    id=ID,
    summary="dist_checkpointing offsets of DTensor parameters come from their own mesh and placements, not the dense DP group",
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of 0.19.2",
        "closest upstream: NVIDIA/Megatron-LM#4553 (Megatron-FSDP checkpoint fails with tensor and expert "
        "parallelism; fixed by NVIDIA/Megatron-LM#4664, which keeps the TP placement of split GDN tensors so they "
        "are not validated against a DP-only mesh). Same class of bug, DTensor checkpoint metadata taken from the "
        "wrong mesh under EP, on Megatron-FSDP's fsdp_dtensor path; this fix covers dist_checkpointing's helpers "
        "(make_[tp_]sharded_tensor_for_checkpoint) and SequentialMLP, which no upstream change addresses",
    ),
    targets=(
        Target(
            UTILS,
            f"{__name__}.runtime.core:probe_utils",
            f"{__name__}.runtime.core:apply_utils",
            alias_sites=(
                "megatron.core.transformer.utils",
                "megatron.core.tensor_parallel.layers",
                "megatron.core.models.common.language_module.language_module",
                "megatron.core.transformer.moe.shared_experts",
                "megatron.core.transformer.multi_latent_attention",
                "megatron.core.transformer.multi_token_prediction",
                "megatron.core.optimizer.optimizer",
                "megatron.core.ssm.mamba_mixer",
            ),
        ),
        Target(
            EXPERTS, f"{__name__}.runtime.core:probe_sequential_mlp", f"{__name__}.runtime.core:apply_sequential_mlp"
        ),
    ),
)
