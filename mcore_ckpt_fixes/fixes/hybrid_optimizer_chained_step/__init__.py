"""hybrid-optimizer-chained-step: ``--optimizer-cpu-offload`` with a chained optimizer (the dense
and expert optimizers of a MoE model) saves and resumes on 0.14.0.

``ChainedOptimizer._synchronize_steps`` aligns the step of every param group before a save and
after a load. 0.14.0 writes the common step into every group, and where no group keeps one (a
``HybridDeviceOptimizer``'s groups never do: its sub-optimizers count the steps) it writes None.
With every parameter offloaded the load stops (``TypeError: must be real number, not NoneType``);
with a GPU sub-optimizer the None reaches its groups and the next step fails.

Upstream: THUDM/slime#1032, #1070 (workaround). Affected: Megatron-Core 0.14.0 (0.15.0 writes the
step only into groups that keep one). How: where the release wrote None, the group gets back what
it had. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-chained-step"
MODULE = "megatron.core.optimizer.optimizer"
CLASS = "ChainedOptimizer"
FUNCTION = "_synchronize_steps"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload with a chained (dense + expert) optimizer: the save no longer writes a "
        "None step into the hybrid optimizers' param groups, which stopped the load (TypeError) or the "
        "next step"
    ),
    affected="==0.14.0",
    upstream=(
        "THUDM/slime#1032 (the failure)",
        "THUDM/slime#1070 (drops a None step from the saved param groups)",
    ),
    targets=(Target(MODULE),),
)
