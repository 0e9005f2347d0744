"""hybrid-optimizer-gpu-step as Megatron-Core would carry it, in
``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``: at the end of
``HybridDeviceOptimizer._sync_hdo_param_groups_to_sub_optimizers`` a ``step`` in the hybrid
optimizer's param groups (a load's) is dropped once the sub-optimizers have it; and in
``megatron/core/optimizer/distrib_optimizer.py``: ``DistributedOptimizer.state_dict`` takes a hybrid
optimizer's step from its GPU FusedAdam's groups where no CPU optimizer has one, as runtime/core.py's
layers do. tests/patches runs the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

HYBRID = "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py"
DISTRIB = "megatron/core/optimizer/distrib_optimizer.py"

_OLD = "                new_param_groups.append(new_group)\n            optimizer.param_groups = new_param_groups\n"
_NEW = (
    "                new_param_groups.append(new_group)\n"
    "            optimizer.param_groups = new_param_groups\n"
    "\n"
    "        # A loaded 'step' is now the sub-optimizers' (a FusedAdam counts it in its param groups);\n"
    "        # copied again before every step it would set their counter back each time.\n"
    "        for group in self.param_groups:\n"
    "            group.pop('step', None)\n"
)


# The end of state_dict's hybrid branch, after the loop over the CPU optimizers (0.12-0.19.2 alike).
_STEP_OLD = "                    step = steps[0]\n                    break\n"
_STEP_NEW = (
    _STEP_OLD
    + "            if step is None and self.optimizer.gpu_optimizer is not None:\n"
    "                # Nothing offloaded (no CPU optimizer has a step): the GPU FusedAdam counts in its groups.\n"
    "                steps = {\n"
    "                    g['step'] for g in self.optimizer.gpu_optimizer.param_groups if g['params'] and 'step' in g\n"
    "                }\n"
    "                step = steps.pop() if len(steps) == 1 else None\n"
)


def source_edits(release: str) -> list:
    return [Replace(HYBRID, _OLD, _NEW), Replace(DISTRIB, _STEP_OLD, _STEP_NEW)]
