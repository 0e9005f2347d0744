"""legacy-save-writers as Megatron-Core would carry it: ``megatron/training/checkpointing.py`` gets
``_writes_legacy_checkpoint`` above ``save_checkpoint`` (its text from runtime/core.py's replacement
section, the code the monkeypatch runs), and the writers' condition of a legacy save asks it instead
of ``mpu.get_expert_data_parallel_rank() == 0``; other formats are decided as before, without the
exchange (the legacy test comes first). tests/patches runs the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before, replacement_section

CHECKPOINTING = "megatron/training/checkpointing.py"

_CONDITION = (
    "            or mpu.get_expert_data_parallel_rank() == 0 \\\n"
    "            or ckpt_type != CheckpointType.LEGACY:\n"
)
_ELECTED = (
    "            or ckpt_type != CheckpointType.LEGACY \\\n"
    "            or _writes_legacy_checkpoint(checkpoint_name):\n"
)


def _helper() -> str:
    from ..runtime import core

    return replacement_section(core).strip("\n") + "\n\n\n"


def source_edits(release: str) -> list:
    return [
        insert_before(CHECKPOINTING, "def save_checkpoint(iteration, model, optimizer,", _helper()),
        Replace(CHECKPOINTING, _CONDITION, _ELECTED),
    ]
