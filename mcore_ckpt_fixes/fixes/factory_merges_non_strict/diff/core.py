"""factory-merges-non-strict as Megatron-Core would carry it: in
``megatron/core/dist_checkpointing/serialization.py`` ``load`` merges the factories through
``_factories_loaded`` (from runtime/core.py's replacement section: the code the monkeypatch runs),
which leaves out those whose tensors the request left out; the helper goes in above ``load``.
tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

SERIALIZATION = "megatron/core/dist_checkpointing/serialization.py"

_MERGE = "    loaded_state_dict = apply_factory_merges(common_state_dict, sh_ten_factories)\n"
_MERGE_LOADED = (
    "    loaded_state_dict = apply_factory_merges(\n"
    "        common_state_dict, _factories_loaded(common_state_dict, sh_ten_factories)\n"
    "    )\n"
)


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [Replace(SERIALIZATION, _MERGE, _MERGE_LOADED), insert_before(SERIALIZATION, "def load(\n", _helper())]
