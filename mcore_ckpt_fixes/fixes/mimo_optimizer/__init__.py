"""mimo-optimizer: ``MimoOptimizer`` checkpoints with non-colocated modules save and load every module.

With the modules on disjoint ranks, as ``MimoOptimizer`` is built for heterogeneous parallelism:
0.17 loses (a) the ``optimizer`` sub-dict and (b) the sharding type of every module off global rank
0, and (c) makes every TP rank a main replica; (d) the inner optimizers of two modules name their
checkpoint objects alike and the save fails (``Duplicate ShardedObject keys``, 0.17-0.18); (e) every
plain value of an inner optimizer's state (torch Adam's shared step) is kept for the module on
global rank 0 only, so the others stop with ``KeyError: 'step'`` (0.17-0.19.2).

Upstream: (a)-(c) fixed in 0.18.0 (NVIDIA/Megatron-LM#4801, #4791), (d) in 0.19.0 (the prefix
#5263 proposed); (e) and reading the 0.17/0.18 layout are not upstream as of 0.19.2.
Affected: Megatron-Core 0.17.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
    targets=(Target(MODULE),),
)
