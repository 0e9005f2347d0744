"""dist-optim-mixed-dtype-order as Megatron-Core would carry it: the minimal edit of
``DistributedOptimizer._build_optimizer_group_ranges`` (``megatron/core/optimizer/distrib_optimizer.py``):
before the method returns, each group's parameters are ordered as the optimizer's group will hold
their shards (fp32 first) and numbered in that order, as runtime/core.py's wrapper does.
tests/patches proves the diff by running the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_before

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_ANCHOR = "        # Squeeze zero-size group ranges.\n"
_NEW = (
    "        # _build_model_and_main_param_groups gives the optimizer's group the fp32 parameters'\n"
    "        # shards first, then the others: number each parameter at its own shard's place, so that\n"
    "        # a group of mixed dtypes saves and loads each parameter's own state.\n"
    "        for group_index, group_range in enumerate(group_ranges):\n"
    "            params = group_range[\"params\"]\n"
    "            fp32 = [p for p in params if p.type() == 'torch.cuda.FloatTensor']\n"
    "            params[:] = fp32 + [p for p in params if p.type() != 'torch.cuda.FloatTensor']\n"
    "            for group_order, param in enumerate(params):\n"
    "                local_param_group_map[param] = (group_index, group_order)\n"
    "\n"
)


def source_edits(release: str) -> list:
    return [insert_before(TARGET, _ANCHOR, _NEW)]
