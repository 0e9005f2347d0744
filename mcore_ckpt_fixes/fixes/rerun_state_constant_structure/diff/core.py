"""rerun-state-constant-structure as Megatron-Core would carry it: in
``megatron/core/rerun_state_machine.py``, ``RerunStateMachine.state_dict`` returns None with no rerun
pending only where the machine is disabled or the format is not ``torch_dist``; otherwise it goes on
to its full state, with no data iterator while no rerun is pending (the monkeypatch's
``force=True`` call with ``data_iterator=None``). tests/patches runs the same round trip with the
monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

TARGET = "megatron/core/rerun_state_machine.py"

_SHORT_CUT = "            if self.state == RerunState.NOT_RUNNING_YET:\n                return None\n"
_KEPT = (
    "            # A validating machine saves one structure whether a rerun is pending or not: a save\n"
    "            # plan cached from a steady-state save (--ckpt-assume-constant-structure) must cover\n"
    "            # the fault-time save, or its rerun state is not written.\n"
    "            if self.state == RerunState.NOT_RUNNING_YET and (\n"
    '                self.mode == RerunMode.DISABLED or ckpt_format != "torch_dist"\n'
    "            ):\n"
    "                return None\n"
)
_SANITIZE = (
    "                return None\n"
    "\n"
    "        data_iterators: list[RerunDataIterator] = self._sanitize_data_iterators(data_iterator)\n"
)
_NO_REPLAY = (
    "                return None\n"
    "\n"
    "        if self.state == RerunState.NOT_RUNNING_YET and not force:\n"
    "            data_iterator = None  # no replay buffers to keep while no rerun is pending\n"
    "        data_iterators: list[RerunDataIterator] = self._sanitize_data_iterators(data_iterator)\n"
)


def source_edits(release: str) -> list:
    return [Replace(TARGET, _SHORT_CUT, _KEPT), Replace(TARGET, _SANITIZE, _NO_REPLAY)]
