"""dp-reshardable-padding as Megatron-Core would carry it: ``megatron/core/optimizer/distrib_optimizer.py``
gets the helper that adds the padding pieces the release's gap filling cannot make (its text taken
from runtime/core.py's replacement section, the code the monkeypatch runs), above
``DistributedOptimizer``, and ``sharded_param_state_dp_reshardable`` passes the state it describes
through it. tests/patches runs the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_after, insert_before, replacement_section

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_CLASS = "class DistributedOptimizer(MixedPrecisionOptimizer):\n"
_STATE = "        state = self.get_parameter_state_dp_reshardable()\n"
_CALL = "        _pad_to_unpadded_bucket_ends(self, state)\n"


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).lstrip("\n").rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [insert_before(TARGET, _CLASS, _helper()), insert_after(TARGET, _STATE, _CALL)]
