"""rerun-state-strict-load as Megatron-Core would carry it: in
``megatron/core/dist_checkpointing/validation.py``'s ``_determine_missing_and_unexpected_keys`` the
missing keys leave out ``rerun_state_machine_state`` (no rank asks for it exactly when
``load_checkpoint`` ignores the saved rerun state on purpose), the same change as runtime/core.py's
wrapper. tests/patches proves the diff by running the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace
from .. import RERUN_KEY

TARGET = "megatron/core/dist_checkpointing/validation.py"

_OLD = "        missing_keys = ckpt_keys - global_accessed_keys\n"
_NEW = (
    "        missing_keys = ckpt_keys - global_accessed_keys\n"
    "        # load_checkpoint leaves the saved rerun state out of the request on purpose when there\n"
    "        # is no rerun to restore (another topology, --finetune, an idle machine): not a mismatch.\n"
    f"        missing_keys.discard('{RERUN_KEY}')\n"
)


def source_edits(release: str) -> list:
    return [Replace(TARGET, _OLD, _NEW)]
