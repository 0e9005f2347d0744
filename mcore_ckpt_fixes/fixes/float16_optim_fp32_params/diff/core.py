"""float16-optim-fp32-params as Megatron-Core would carry it: in
``megatron/core/optimizer/optimizer.py``, ``Float16OptimizerWithFloat16Params.sharded_state_dict``
numbers the state by the model parameters in the optimizer's own order
(``_model_params_in_optimizer_order``) and pairs each fp32 copy with its own state id
(``_fp32_copy_ids``); both helpers, from runtime/core.py's replacement section (the code the
monkeypatch runs), go in above the class. On 0.19 the GTP backfill gets the same order.
tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

OPTIMIZER = "megatron/core/optimizer/optimizer.py"

_MAP = "model_sharded_state_dict, chain.from_iterable(g for g in self.float16_groups)\n"
_MAP_IN_ORDER = "model_sharded_state_dict, _model_params_in_optimizer_order(self)\n"
_BACKFILL = "id_to_sharded_param_map, self.float16_groups, model_sharded_state_dict\n"
_BACKFILL_IN_ORDER = "id_to_sharded_param_map, [_model_params_in_optimizer_order(self)], model_sharded_state_dict\n"
_PAIR = "for param_id, fp32_param in zip(state_group['params'], fp32_group)\n"
_PAIR_OWN = "for param_id, fp32_param in zip(copy_ids, fp32_group)\n"
_GROUPS = (
    "            for fp32_group, state_group in zip(\n"
    "                state_dict['fp32_from_fp16_params'], state_dict['optimizer']['param_groups']\n"
    "            )\n"
)
_GROUPS_OWN = (
    "            for fp32_group, copy_ids in zip(\n"
    "                state_dict['fp32_from_fp16_params'],\n"
    "                _fp32_copy_ids(self, state_dict['optimizer']['param_groups']),\n"
    "            )\n"
)


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    edits = [Replace(OPTIMIZER, _MAP, _MAP_IN_ORDER), Replace(OPTIMIZER, _PAIR, _PAIR_OWN), Replace(OPTIMIZER, _GROUPS, _GROUPS_OWN)]
    if release.startswith("0.19"):
        edits.append(Replace(OPTIMIZER, _BACKFILL, _BACKFILL_IN_ORDER))
    return edits + [insert_before(OPTIMIZER, "class Float16OptimizerWithFloat16Params(", _helpers())]
