"""param-group-identity as Megatron-Core would carry it: ``megatron/core/optimizer/optimizer.py`` gets
the helper that chooses the identifier keys (its text taken from runtime/core.py's replacement
section, the code the monkeypatch runs), and the two places that match saved parameter groups to
current ones (``MegatronOptimizer._filter_and_reorder_param_groups``,
``DistributedOptimizer.load_state_dict`` in ``distrib_optimizer.py``) use the keys it chooses instead
of ``param_group_identifier_keys``. The source reaches a ``DistributedOptimizer`` loaded on its own
too (the monkeypatch reaches it through ``ChainedOptimizer``); tests/patches runs the same round trip
with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_after, insert_before, replacement_section

OPTIMIZER = "megatron/core/optimizer/optimizer.py"
DISTRIB = "megatron/core/optimizer/distrib_optimizer.py"

_KEYS_LINE = "param_group_identifier_keys = ('wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr')\n"
_FILTER_START = "        # Define groups order that is needed in the current optimizer (coming from runtime)\n"
_FILTER_KEYS = "        identifier_keys = _param_group_identifier_keys_for(current_groups, state_dict_groups)\n"
_IMPORT_OLD = "from .optimizer import MixedPrecisionOptimizer, _zero_grad_group_helper, param_group_identifier_keys\n"
_IMPORT_NEW = (
    "from .optimizer import (\n"
    "    MixedPrecisionOptimizer,\n"
    "    _param_group_identifier_keys_for,\n"
    "    _zero_grad_group_helper,\n"
    "    param_group_identifier_keys,\n"
    ")\n"
)
_LOAD_KEYS = (
    "        identifier_keys = _param_group_identifier_keys_for(\n"
    '            self.optimizer.param_groups, state_dict["optimizer"]["param_groups"]\n'
    "        )\n"
    "\n"
)


def _helper() -> str:
    from ..runtime import core

    return "\n\n" + replacement_section(core).rstrip("\n") + "\n"


# 0.19: the keys are a multi-line tuple (every ParamGroupOverride key, then the structural flags),
# distrib_optimizer imports names from .optimizer in a parenthesised list.
_KEYS_END_019 = "    'is_decoupled_lr',\n)\n"
_FILTER_START_019 = "        def _identifier_for(group: dict) -> tuple:\n"
_FILTER_LOOP_019 = "            for key in param_group_identifier_keys:\n"
_IMPORT_OLD_019 = "from .optimizer import (\n    MixedPrecisionOptimizer,\n"
_IMPORT_NEW_019 = "from .optimizer import (\n    MixedPrecisionOptimizer,\n    _param_group_identifier_keys_for,\n"


def _source_edits_019() -> list:
    return [
        insert_after(OPTIMIZER, _KEYS_END_019, _helper()),
        insert_before(OPTIMIZER, _FILTER_START_019, _FILTER_KEYS + "\n"),
        Replace(OPTIMIZER, _FILTER_LOOP_019, "            for key in identifier_keys:\n"),
        Replace(DISTRIB, _IMPORT_OLD_019, _IMPORT_NEW_019),
        insert_before(DISTRIB, "        def make_needed_groups(param_group):\n", _LOAD_KEYS),
        Replace(DISTRIB, _FILTER_LOOP_019, "            for key in identifier_keys:\n"),
    ]


def source_edits(release: str) -> list:
    if release.startswith("0.19."):
        return _source_edits_019()
    return [
        insert_after(OPTIMIZER, _KEYS_LINE, _helper()),
        insert_before(OPTIMIZER, _FILTER_START, _FILTER_KEYS),
        Replace(OPTIMIZER, "for key in param_group_identifier_keys)\n", "for key in identifier_keys)\n"),
        Replace(OPTIMIZER, "                for key in param_group_identifier_keys\n", "                for key in identifier_keys\n"),
        Replace(DISTRIB, _IMPORT_OLD, _IMPORT_NEW),
        insert_before(DISTRIB, "        def make_needed_groups(param_group):\n", _LOAD_KEYS),
        Replace(DISTRIB, "            for key in param_group_identifier_keys:\n", "            for key in identifier_keys:\n"),
    ]
