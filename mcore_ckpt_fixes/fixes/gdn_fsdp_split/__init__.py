"""gdn-fsdp-split: fsdp_dtensor save of Gated-DeltaNet fused projections, rank-consistent, no collectives.

Affected: Megatron-Core 0.18.x (TP split applied twice) and 0.19.x (per-rank fast path, hang risk).
Upstream: NVIDIA/Megatron-LM #4748/#4753 (the 0.19 fast path for "already TP-local" GDN tensors,
Qwen3.5 via Megatron-Bridge), #4799/#4843 (same, dev/cherry-pick), #4423 (plain-Tensor optimizer
states), #4910 (the hang signature when ranks disagree).

Failure prevented (0.18.x): ``handle_gdn_in_state_dict`` splits GDN's fused ``in_proj.weight``
(query, key, value, z, beta, alpha) and ``conv1d.weight`` / ``conv1d.bias`` (query, key, value)
through a nested ``split_gdn_fused``. It divides ``data.numel()`` by the TP size to get one TP
rank's share. When ``data`` is already TP-local (its DTensor *global* shape is this TP rank's
shape, as Megatron-Bridge / verl hand it over), the TP split is applied a second time: every
component gets half its rows, ``make_fsdp_dtensor`` rebuilds it as a TP-global DTensor twice too
small, and the save dies in ``validate_uneven_dtensor`` with
``AssertionError: [Megatron-FSDP] DTensor chunk metadata boundary check failed``.
A plain-Tensor optimizer state (FusedAdam's local shard) dies in ``data.to_local()``.

Why 0.19.x too: 0.19 detects the TP-local case by ``data.shape[split_dim] == sum(split_sizes)``
per rank and then takes ``split_dtensor`` (one ``all_gather_object`` per sharded mesh dim to find
offsets, and another per component to attach chunk metadata), while the other branch runs
``make_fsdp_dtensor(run_check=True)`` (``all_gather_object`` + ``all_reduce`` per component, and
another ``all_gather_object``). The choice depends on what *this* rank holds: where ranks disagree
(a plain Tensor on one rank, a DTensor on another; a TP-local DTensor on one, a TP-global one on
another; optimizer state on some ranks only) the collectives do not pair up and the job hangs.
The fast path also writes the TP-local tensor as if it were global, so both TP ranks write the
same chunk of ``...in_proj.weight.query`` and one TP rank's values are lost (no TP resharding).
So the replacement is applied on 0.19.x as well: it is the same function with both branches
replaced by one rank-independent computation.

How: a replacement ``handle_gdn_in_state_dict`` (module-level, bound in
``megatron.core.transformer.fsdp_dtensor_checkpoint`` and in every module that imported it by name)
keeps upstream's key matching and dict handling and splits without any collective. Whatever
``data`` is (TP-global DTensor, TP-local DTensor, plain local Tensor), its local part is this rank's
Megatron-FSDP slice of the TP-local fused parameter (``dist_param.megatron_fsdp_slice``); the TP
size and rank come from the parameter's ``FSDPDistributedIndex`` mesh coordinates, the component
sizes from the GDN module. From those alone every rank computes each component's piece (a view,
so loading into it writes straight back into the fused tensor), its TP-global shape
``(size * tp, ...)`` and its chunk offset ``tp_rank * size + rows before this rank's slice``, and
attaches the chunk metadata DCP reads. The result is the checkpoint upstream's working branch
writes for the ordinary (TP-global) layout, on every rank, for every input layout.

Plain torch DTensors (``distribute_tensor`` / ``DTensor.from_local`` on a CPU or CUDA mesh, no
Megatron-FSDP attributes: what a script that distributes Hugging Face weights hands over) carry
their place in their own mesh and placements: the local chunk is computed from the mesh coordinate
with torch's chunking (Shard(0) on 1-D and 2-D meshes, nested Shard, Replicate; chunk metadata that
Megatron-FSDP attached wins), the TP rank of a TP-local tensor comes from a TP=1 module, the
parameter's Megatron-FSDP mesh, a ``"tp"`` mesh dimension or ``parallel_state``, and a TP-global
tensor's rows name their TP block. 0.19.2 splits such TP=1 tensors itself (so must the fix: it may
never fail where the release succeeds); 0.18.x raises ``AttributeError: 'DTensor' object has no
attribute 'megatron_fsdp_slice'``. Layouts with no contiguous local chunk (Partial, strided shards,
a local part spanning TP blocks, a TP-local tensor whose TP rank nothing names) are refused with
one ``ValueError`` line: upstream either fails on them too or writes TP ranks over each other.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "gdn-fsdp-split"
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
NAME = "handle_gdn_in_state_dict"

# Modules known to bind the function by name (the engine rebinds every loaded module anyway).
ALIAS_SITES = ("megatron.bridge.training.checkpointing",)

FIX = Fix(
    id=ID,
    summary="fsdp_dtensor save of Gated-DeltaNet fused projections: TP split applied twice (0.18), "
    "per-rank fast path with mismatched collectives (0.19); replaced by a collective-free split",
    affected=">=0.18.0,<0.20.0",
    upstream=(
        "NVIDIA/Megatron-LM#4748/#4753/#4843 (0.19 fast path for TP-local GDN tensors)",
        "NVIDIA/Megatron-LM#4910 (hang when ranks take different branches)",
        "NVIDIA/Megatron-LM#4423 (plain-Tensor optimizer states)",
    ),
    targets=(
        Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply", alias_sites=ALIAS_SITES),
    ),
)
