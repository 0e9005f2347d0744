"""hybrid-optimizer-fp32-params as Megatron-Core would carry it: the minimal edit of the release's
own loop in ``HybridDeviceOptimizer._update_fp32_params_by_new_state``
(``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``): a parameter that
``param_to_fp32_param`` does not map is skipped instead of looked up, the same change as
runtime/core.py's wrapper (which hands the mapped parameters to the release's method).
tests/patches proves the diff by running the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

TARGET = "megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py"

_OLD = (
    "        for param, v in self.state.items():\n"
    "            fp32_param = self.param_to_fp32_param[param]\n"
    '            fp32_param.data.copy_(v["master_param"])\n'
)
_NEW = (
    "        for param, v in self.state.items():\n"
    "            if param not in self.param_to_fp32_param:\n"
    "                # fp32 already (no copy was made): the optimizer updates the parameter (or its\n"
    "                # CPU copy) itself, which keeps what the load restored.\n"
    "                continue\n"
    "            fp32_param = self.param_to_fp32_param[param]\n"
    '            fp32_param.data.copy_(v["master_param"])\n'
)


def source_edits(release: str) -> list:
    return [Replace(TARGET, _OLD, _NEW)]
