"""scheduler-checkpoint-wd as Megatron-Core would carry it, in
``megatron/core/optimizer_param_scheduler.py``: ``load_state_dict`` sets the param groups' lr and
weight decay again (``self.step(increment=0)``) once it has restored the checkpoint's weight-decay
fields, the same change as runtime/core.py's layer. tests/patches proves the diff by running the
same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_after

TARGET = "megatron/core/optimizer_param_scheduler.py"

# The last of the weight-decay fields the load restores (after it has stepped the groups).
_WD_RESTORED = (
    "            self.wd_incr_style = self._check_and_set(\n"
    "                self.wd_incr_style, state_dict['wd_incr_style'], \"weight decay incr style\"\n"
    "            )\n"
)
_STEP_AGAIN = (
    "            # The groups were stepped above with this run's weight-decay arguments: set their lr\n"
    "            # and weight decay again from the values just restored.\n"
    "            self.step(increment=0)\n"
)


def source_edits(release: str) -> list:
    return [insert_after(TARGET, _WD_RESTORED, _STEP_AGAIN)]
