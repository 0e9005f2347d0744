"""hybrid-optimizer-gpu-step as Megatron-Core would carry it, in
``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``: at the end of
``HybridDeviceOptimizer._sync_hdo_param_groups_to_sub_optimizers`` a ``step`` in the hybrid
optimizer's param groups (a load's) is dropped once the sub-optimizers have it, as runtime/core.py's
layer does after the release's call. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

HYBRID = "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py"

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


def source_edits(release: str) -> list:
    return [Replace(HYBRID, _OLD, _NEW)]
