"""mimo-optimizer: ``MimoOptimizer`` checkpoints with non-colocated modules save and load every module.

Affected: Megatron-Core 0.17.x (five defects), 0.18.x (two) and 0.19.x (one, and the load side);
``megatron.core.models.mimo`` appeared in 0.17.0, so 0.16 is not-applicable. Upstream: NVIDIA/Megatron-LM's MIMO optimizer
checkpointing changes that shipped in 0.18.0 (``setdefault('optimizer')`` on load,
``param_state_sharding_type`` as a ShardedObject, TP rank in ``_get_replica_id``) and in 0.19.0
(``add_prefix_for_sharding(module_sd, 'mimo.<module>.')``).

Failures prevented, with the modules on disjoint ranks (rank 0 the language model, rank 1 the
vision encoder), as ``MimoOptimizer`` is built for heterogeneous parallelism:

(a) 0.17: ``dist_checkpointing`` keeps plain (non-sharded) values in the common state that only
    global rank 0 writes. A module not active on rank 0 loses its ``optimizer`` sub-dict, and
    ``MimoOptimizer.load_state_dict`` raises ``KeyError: 'optimizer'``.
(b) 0.17: ``param_state_sharding_type`` is plain too, so the other modules never get theirs back
    (``DistributedOptimizer.load_state_dict`` asserts it is there).
(c) 0.17: ``_get_replica_id`` returns ``(0, pp, dp)``: every TP rank claims to be the main replica
    of the module's param groups (``Duplicate ShardedObject keys ... param_groups``).
(d) 0.17 and 0.18: the inner ``DistributedOptimizer``s of two modules name their ShardedObjects and
    ShardedTensors alike (``optimizer.distributed.dp_group_idx_0...``: the index is the rank in the
    module's own model-parallel group), so the save fails with ``Duplicate ShardedObject keys``.
(e) 0.17-0.19.2 (not fixed upstream): every other plain value an inner optimizer returns is common
    state too. Megatron's non-distributed optimizers (``Float16OptimizerWithFloat16Params``,
    ``FP32Optimizer``) over torch's Adam/AdamW (Megatron's fallback without TE/Apex) keep the step
    shared by all parameters as ``optimizer.state.common_step`` (megatron/core/optimizer/optimizer.py,
    0.19.2 lines 1176-1188): a module off global rank 0 loads its exp_avg/exp_avg_sq without a step
    and torch's ``Adam.__setstate__`` raises ``KeyError: 'step'`` (upstream's own
    tests/unit_tests/models/mimo/test_mimo_checkpoint.py configuration, run on CPU).

How: on 0.17/0.18 ``MimoOptimizer.sharded_state_dict`` and ``load_state_dict`` are replaced by
versions that write what 0.19 writes (so a checkpoint saved by a patched 0.17/0.18 loads on 0.19):
param groups, sharding type and grad scaler as per-module ShardedObjects whose replica id is
``(tp, pp, dp)``, the emptied ``optimizer`` sub-dict dropped, and every inner key prefixed with
``mimo.<module>.``. On load, the missing ``optimizer`` sub-dict is recreated. (e), on every affected
release (on 0.19 by wrapping upstream's two methods): one more per-module ShardedObject,
``mimo.<module>.optimizer.mimo.<module>[.<i>].common_state``, holds a copy of every plain value of
the module's optimizer state dict (whole plain subtrees with their paths, see ``common_state.py``);
the values also stay where they were, so rank 0's common state, and what any loader that read the
previous layout gets from it, are unchanged. The load puts each module's own values back before its
inner optimizer loads.

Reading what unfixed releases wrote (0.17.x-0.19.x): in the configurations an unpatched 0.17/0.18
can save (one module with an optimizer, e.g. a frozen encoder) its MIMO optimizer keys carry no
``mimo.<module>.`` prefix and, on 0.17, the sharding type sits in the common state that only global
rank 0 writes (so a module on another rank has none). The keys a load asks for are fixed in
``sharded_state_dict`` before anything opens the checkpoint, so this half wraps
``dist_checkpointing.load``: when the request holds ``mimo.<module>.`` keys, it reads the checkpoint's
metadata (names only); for a module whose state is stored only under the unprefixed names it asks for
those, fills a sharding type the checkpoint does not have with the one the load requested (its keys
are that type's keys, or the load would fail on them), and emits one ``MegatronPatchWarning`` naming
the old layout. A checkpoint without a module's common-state object (every unpatched 0.17-0.19.2
release, and earlier versions of this fix) loads too: the object is not asked for; what it would
hold is in the checkpoint only for the module on global rank 0; for another module a missing
``common_step`` under per-parameter state is taken from a module that has one (MimoOptimizer steps
every module together), any other missing value from the load's own request, each named in a
``MegatronPatchWarning``. The probe runs the real ``MimoOptimizer`` methods on stand-in inner
optimizers (defects (a)-(e)) and the real ``dist_checkpointing.load`` on a checkpoint held in memory
(the names its metadata lists; nothing is written or read) and a recording load strategy, so a
source-patched Megatron is recognised as fixed.
"""

from ...engine.fix import Fix, Target

ID = "mimo-optimizer"
MODULE = "megatron.core.models.mimo.optimizer"
LOAD_MODULE = "megatron.core.dist_checkpointing.serialization"

FIX = Fix(
    id=ID,
    summary=(
        "MimoOptimizer checkpoints with non-colocated modules keep every module's state, common state "
        "(e.g. torch Adam's step), sharding type and keys, and the layouts unfixed releases wrote still load"
    ),
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "fixed upstream in Megatron-Core 0.18.0 (a, b, c) and 0.19.0 (d): megatron/core/models/mimo/optimizer.py",
        "NVIDIA/Megatron-LM #4801 (TP rank in _get_replica_id, setdefault('optimizer') on load: defects c, a) and "
        "#4791 (param_state_sharding_type as a per-module ShardedObject: defect b)",
        "NVIDIA/Megatron-LM #5263 (closed): proposed the 'mimo.<module>.' prefix of defect (d) that 0.19.0 ships",
        "reading the 0.17/0.18 layout: not upstream as of 0.19.2 (0.19 reads only its own layout)",
        "each module's common state (e): not upstream as of 0.19.2 (upstream's test_mimo_checkpoint.py "
        "fails with KeyError: 'step' on CPU with torch Adam)",
    ),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
