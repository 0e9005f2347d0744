"""strictness-return-keys as Megatron-Core would carry it: in ``megatron/training/checkpointing.py``
``_load_global_dist_base_checkpoint`` loads through ``_load_state_dict_alone`` (below), which calls
``dist_checkpointing.load`` as before and hands back the state dict alone, the mismatching keys it
returned under return_unexpected / return_all logged by ``_state_dict_alone`` (its text, and the
constant and helper beside it, from runtime/core.py's replacement section: the code the monkeypatch
runs). Both go in above ``load_checkpoint``, whose state dict they hand back.

The call's first line is the one line edited in the loader, and the helpers go where no other diff
edits: rng-under-ep's diff edits the loader's lines after the call and its RNG request before it,
and inserts before the loader; fsdp-dtensor-pp-guard's inserts after it. The diffs apply together,
in any order.
tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

CHECKPOINTING = "megatron/training/checkpointing.py"

_CALL = "    state_dict = dist_checkpointing.load(\n"
_CALL_ALONE = "    state_dict = _load_state_dict_alone(\n        dist_checkpointing.load,\n"

_LOADER = '''def _load_state_dict_alone(load, *args, **kwargs):
    """``load(*args, **kwargs)`` (dist_checkpointing.load): its state dict alone, whatever the
    --dist-ckpt-strictness (see _state_dict_alone)."""
    return _state_dict_alone(load(*args, **kwargs))


'''


def _helpers() -> str:
    from ..runtime import core

    return _LOADER + replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [
        Replace(CHECKPOINTING, _CALL, _CALL_ALONE),
        insert_before(CHECKPOINTING, "def load_checkpoint(", _helpers()),
    ]
