"""fsdp-dtensor-pp-guard as Megatron-LM would carry it: ``megatron/training/checkpointing.py`` gets
``_refuse_fsdp_dtensor_pipeline_change`` above ``_load_base_checkpoint`` (its text from
runtime/core.py's replacement section, the code the monkeypatch runs), called where
``_load_base_checkpoint`` returns a fsdp_dtensor checkpoint's state: the arguments-only read of 0.19
and the full load. tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

CHECKPOINTING = "megatron/training/checkpointing.py"

_FULL = "    return state_dict, checkpoint_name, release, ckpt_type\n"
_ARGS_ONLY = "            return state_dict, checkpoint_name, release, CheckpointType.FSDP_DTENSOR\n"


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def _guarded(ret: str, fsdp_dtensor_only: bool) -> str:
    indent = ret[: len(ret) - len(ret.lstrip())]
    check = f"{indent}_refuse_fsdp_dtensor_pipeline_change(state_dict, args, checkpoint_name)\n"
    if fsdp_dtensor_only:
        check = f"{indent}if ckpt_type == CheckpointType.FSDP_DTENSOR:\n    " + check
    return check + ret


def source_edits(release: str) -> list:
    edits = [
        insert_before(CHECKPOINTING, "def _load_base_checkpoint(", _helper()),
        Replace(CHECKPOINTING, _FULL, _guarded(_FULL, True)),
    ]
    if tuple(int(p) for p in release.split(".")[:2]) >= (0, 19):  # the arguments read on their own
        edits.append(Replace(CHECKPOINTING, _ARGS_ONLY, _guarded(_ARGS_ONLY, False)))
    return edits
