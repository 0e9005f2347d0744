"""ep-change-optimizer-chain as Megatron-Core would carry it: ``megatron/core/optimizer/optimizer.py``
gets the helper that puts a state dict mixing two chains' shapes into the loading chain's shape (its
text taken from runtime/core.py's replacement section, the code the monkeypatch runs), above
``ChainedOptimizer``, and ``ChainedOptimizer.load_state_dict`` reads the helper's state dict where it
gives one. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_before, replacement_section

OPTIMIZER = "megatron/core/optimizer/optimizer.py"

_CLASS = "class ChainedOptimizer(MegatronOptimizer):\n"
_LOAD_START = "        # If there is only one optimizer, we read the state dict as a single optimizer.\n"
_RESHAPE = (
    "        # A checkpoint saved under another expert-parallel size (one optimizer vs dense + expert).\n"
    "        in_chain_shape = _optimizer_state_in_chain_shape(self, state_dict)\n"
    "        if in_chain_shape is not None:\n"
    "            state_dict = in_chain_shape\n"
)


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).lstrip("\n").rstrip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [insert_before(OPTIMIZER, _CLASS, _helper()), insert_before(OPTIMIZER, _LOAD_START, _RESHAPE)]
