"""load-main-params-substring-match as Megatron-Core would carry it:
``megatron/core/optimizer/distrib_optimizer.py`` gets ``_state_dict_keys_naming`` above
``DistributedOptimizer`` (its text taken from runtime/core.py's replacement section, the code the
monkeypatch runs), and ``_build_model_param_to_state_dict_param_map`` asks it for a parameter's
keys instead of ``name in k``. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

DISTRIB_OPTIMIZER = "megatron/core/optimizer/distrib_optimizer.py"

_CLASS = "class DistributedOptimizer(MixedPrecisionOptimizer):\n"
_MATCH = "                matched_keys = [k for k in names_in_state_dict if name in k]\n"
_NAMING = "                matched_keys = _state_dict_keys_naming(name, names_in_state_dict)\n"


def _keys_naming() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [insert_before(DISTRIB_OPTIMIZER, _CLASS, _keys_naming()), Replace(DISTRIB_OPTIMIZER, _MATCH, _NAMING)]
