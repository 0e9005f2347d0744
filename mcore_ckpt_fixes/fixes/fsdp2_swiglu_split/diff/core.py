"""fsdp2-swiglu-split as Megatron-Core would carry it: ``megatron/core/transformer/mlp.py`` gets
``_swiglu_factory_for_dtensor_shard`` and its helpers above ``class MLP`` (their text taken from
runtime/core.py's replacement section, the code the monkeypatch runs), and
``MLP.sharded_state_dict`` hands each factory ``apply_swiglu_sharded_factory`` builds to it, with
the parameter it describes. ``megatron/core/dist_checkpointing/serialization.py`` gets the layout
marks and the old-layout read above ``def load`` (runtime/layout.py's replacement section):
``save`` adds the marks to what it writes, ``load`` reads unmarked shards as they were written
before it applies the factories. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, Transform, insert_before, replacement_section

MLP_FILE = "megatron/core/transformer/mlp.py"
SERIALIZATION_FILE = "megatron/core/dist_checkpointing/serialization.py"
_LOAD = "\ndef load(\n"
_SAVE_CALL = "    sharded_state_dict, state_dict = save_preprocess("
_LOAD_CALL = "    sharded_state_dict, nonpersistent_state_dict, sh_ten_factories = load_preprocess(\n"
_CLASS = "class MLP(MegatronModule):\n"
_CALL = "sub_sd[k] = apply_swiglu_sharded_factory("


def _helpers() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def _layout_helpers() -> str:
    from ..runtime import layout

    return "\n" + replacement_section(layout).strip("\n") + "\n\n"


def _call_end(text: str, at: int) -> int:
    """The index just past the ``)`` closing the call whose ``(`` is the first one from ``at``."""
    depth = 0
    for i in range(text.index("(", at), len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise PatchgenError(f"unclosed call at {at}")


def mark_saved_pieces(text: str) -> str:
    """``save``: the marks of the in-place pieces are taken before ``save_preprocess`` applies the
    factories, and written with the sharded part."""
    if text.count(_SAVE_CALL) != 1:
        raise PatchgenError(f"{SERIALIZATION_FILE}: anchor found {text.count(_SAVE_CALL)} times: {_SAVE_CALL!r}")
    at = text.index(_SAVE_CALL)
    end = _call_end(text, at) + 1  # and its newline
    before = "    swiglu_fsdp2_marks = _swiglu_fsdp2_layout_marks(sharded_state_dict)\n"
    after = "    if swiglu_fsdp2_marks:\n        sharded_state_dict[SWIGLU_FSDP2_LAYOUT] = swiglu_fsdp2_marks\n"
    return text[:at] + before + text[at:end] + after + text[end:]


def wrap_factory_call(text: str) -> str:
    """``sub_sd[k] = apply_swiglu_sharded_factory(...)`` (its arguments as the release has them,
    one line or several) -> the same call handed to ``_swiglu_factory_for_dtensor_shard`` with
    the parameter ``k`` names in ``module`` (linear_fc1)."""
    if text.count(_CALL) != 1:
        raise PatchgenError(f"{MLP_FILE}: anchor found {text.count(_CALL)} times (need 1): {_CALL!r}")
    at = text.index(_CALL)
    line_start = text.rfind("\n", 0, at) + 1
    indent = text[line_start:at]
    depth, end = 0, at + len(_CALL) - 1
    for end in range(at + len(_CALL) - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    args = " ".join(text[at + len(_CALL) : end].split())
    new = (
        f"sub_sd[k] = _swiglu_factory_for_dtensor_shard(\n"
        f"{indent}    apply_swiglu_sharded_factory({args}),\n"
        f"{indent}    getattr(module, k.rsplit('.', 1)[1], None),\n"
        f"{indent})"
    )
    return text[:at] + new + text[end + 1 :]


def source_edits(release: str) -> list:
    return [
        insert_before(MLP_FILE, _CLASS, _helpers()),
        Transform(MLP_FILE, wrap_factory_call),
        insert_before(SERIALIZATION_FILE, _LOAD, _layout_helpers()),
        Transform(SERIALIZATION_FILE, mark_saved_pieces),
        insert_before(
            SERIALIZATION_FILE, _LOAD_CALL, "    _read_swiglu_fsdp2_rows_as_written(sharded_state_dict, checkpoint_dir)\n"
        ),
    ]
