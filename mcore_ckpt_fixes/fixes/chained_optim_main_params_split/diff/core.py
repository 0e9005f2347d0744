"""chained-optim-main-params-split as Megatron-Core would carry it: ``megatron/core/optimizer/optimizer.py``
gets the helper that gives each sub-optimizer the state dict of its own model chunks (its text taken
from runtime/core.py's replacement section, the code the monkeypatch runs), above
``ChainedOptimizer``, and ``ChainedOptimizer._split_state_dict`` returns the helper's split where it
has one, else splits as the release does. tests/patches runs the same round trips with the
monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_before, replacement_section

OPTIMIZER = "megatron/core/optimizer/optimizer.py"

_CLASS = "class ChainedOptimizer(MegatronOptimizer):\n"
_SPLIT_START = "        state_dicts = [None] * len(self.chained_optimizers)\n"
_EARLY_RETURN = (
    "        by_own_chunks = _state_dicts_by_own_chunks(self, state_dict)\n"
    "        if by_own_chunks is not None:\n"
    "            return by_own_chunks\n"
)


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).lstrip("\n").rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [insert_before(OPTIMIZER, _CLASS, _helper()), insert_before(OPTIMIZER, _SPLIT_START, _EARLY_RETURN)]
