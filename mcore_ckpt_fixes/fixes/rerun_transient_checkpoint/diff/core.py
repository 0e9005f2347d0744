"""rerun-transient-checkpoint as Megatron-Core would carry it, in
``megatron/core/rerun_state_machine.py`` (the 0.14+ layout, whose common part holds the state):
``should_checkpoint_and_exit`` puts the machine back to ``NOT_RUNNING_YET`` before it asks for the
checkpoint at a transient fault, and ``load_state_dict`` ignores a ``RERUNNING_IN_PLACE`` state
with a warning of the monkeypatch's words. tests/patches runs the same round trip with the
monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_before
from ..runtime.core import IGNORED

TARGET = "megatron/core/rerun_state_machine.py"

_TRANSIENT_EXIT = (
    '                "Exiting now. A checkpoint at the last iteration is being saved "\n'
    '                "if further examination is needed",\n'
    "            )\n"
    "            return True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION\n"
)
_RESUMABLE = (
    '                "Exiting now. A checkpoint at the last iteration is being saved "\n'
    '                "if further examination is needed",\n'
    "            )\n"
    "            # The in-place rerun is over and its RNG snapshot (saved_state) is not checkpointed:\n"
    "            # a machine resumed in RERUNNING_IN_PLACE would restore None. Save a state every\n"
    "            # release resumes from; the step is run again after the resume.\n"
    "            self.state = RerunState.NOT_RUNNING_YET\n"
    "            return True, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION\n"
)
_RESTORING = (
    "        log_single_rank(\n"
    "            logger,\n"
    "            logging.WARNING,\n"
    '            "Getting RerunStateMachine state from checkpoint. Will rerun step.",\n'
    "        )\n"
)


def _ignore_rerunning_in_place() -> str:
    words, lines, line = IGNORED.split(" "), [], ""
    for w in words:  # wrap at ~80 columns, as upstream formats its messages
        if line and len(line) + len(w) > 72:
            lines.append(line)
            line = ""
        line += w + " "
    lines.append(line.rstrip(" "))
    quoted = ['"' + ln.replace('"', '\\"') + '"' for ln in lines]
    message = "".join(f"                {q}\n" for q in quoted)
    return (
        '        if state_dict["state"] == RerunState.RERUNNING_IN_PLACE:\n'
        "            # Saved at a transient fault by a release that checkpointed this state: without\n"
        "            # the step's RNG snapshot it cannot be resumed. Resume as from a regular checkpoint.\n"
        "            logger.warning(\n"
        f"{message}"
        "            )\n"
        "            return\n"
    )


def source_edits(release: str) -> list:
    return [Replace(TARGET, _TRANSIENT_EXIT, _RESUMABLE), insert_before(TARGET, _RESTORING, _ignore_rerunning_in_place())]
