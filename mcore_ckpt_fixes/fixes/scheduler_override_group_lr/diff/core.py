"""scheduler-override-group-lr as Megatron-Core would carry it, in
``megatron/core/optimizer_param_scheduler.py``: ``__init__`` records each param group's max_lr /
min_lr as the run built them, and ``load_state_dict`` ends, under ``override_opt_param_scheduler``,
by giving the groups those values back and setting their lr / weight decay from them: the same
change as runtime/core.py's wrappers. tests/patches proves the diff by running the same round trip
with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace, insert_after

TARGET = "megatron/core/optimizer_param_scheduler.py"

_INIT = "        self.optimizer = optimizer\n"
_RECORD = (
    "        # Each param group's max_lr / min_lr as this run built them: with\n"
    "        # override_opt_param_scheduler they are given back after a checkpoint replaced the groups.\n"
    "        self.built_group_lrs = [\n"
    "            {key: group.get(key) for key in ('max_lr', 'min_lr')} for group in optimizer.param_groups\n"
    "        ]\n"
)
_END = (
    "            self.wd_incr_style = self._check_and_set(\n"
    "                self.wd_incr_style, state_dict['wd_incr_style'], \"weight decay incr style\"\n"
    "            )\n"
)
_RESTORE = (
    "\n"
    "        # The groups came back from the checkpoint with its max_lr / min_lr: the override gives\n"
    "        # them this run's own values, and their lr / weight decay from them.\n"
    "        if self.override_opt_param_scheduler and len(self.built_group_lrs) == len(\n"
    "            self.optimizer.param_groups\n"
    "        ):\n"
    "            for group, built in zip(self.optimizer.param_groups, self.built_group_lrs):\n"
    "                for key, value in built.items():\n"
    "                    if value is None:\n"
    "                        group.pop(key, None)\n"
    "                    else:\n"
    "                        group[key] = value\n"
    "            self.step(increment=0)\n"
)


def source_edits(release: str) -> list:
    return [insert_after(TARGET, _INIT, _RECORD), Replace(TARGET, _END, _END + _RESTORE)]
