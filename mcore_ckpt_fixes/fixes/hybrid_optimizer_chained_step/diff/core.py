"""hybrid-optimizer-chained-step as Megatron-Core would carry it, in
``megatron/core/optimizer/optimizer.py``: ``ChainedOptimizer._synchronize_steps`` writes the common
step into the param groups only where there is one, so a group that keeps no step (a hybrid
optimizer's) is not given None, as runtime/core.py's layer leaves it. tests/patches runs the same
round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

OPTIMIZER = "megatron/core/optimizer/optimizer.py"

_OLD = (
    "        step = steps[0] if len(steps) == 1 else None\n"
    "        for optimizer in self.chained_optimizers:\n"
    "            for param_group in optimizer.optimizer.param_groups:\n"
    "                param_group['step'] = step\n"
)
_NEW = (
    "        step = steps[0] if len(steps) == 1 else None\n"
    "        for optimizer in self.chained_optimizers:\n"
    "            for param_group in optimizer.optimizer.param_groups:\n"
    "                # No group keeps a step (a HybridDeviceOptimizer's never do): write no None.\n"
    "                if step is not None:\n"
    "                    param_group['step'] = step\n"
)


def source_edits(release: str) -> list:
    return [Replace(OPTIMIZER, _OLD, _NEW)]
