"""scheduler-override-group-lr as Megatron-Core would carry it, in
``megatron/core/optimizer_param_scheduler.py``: ``__init__`` records each param group's max_lr /
min_lr as the run built them, and ``load_state_dict``, under ``override_opt_param_scheduler``, gives
the groups those values back once it has stepped them and sets their lr / weight decay from them:
the same values as runtime/core.py's wrappers give (there, after the whole load). tests/patches
proves the diff by running the same round trip with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import insert_after

TARGET = "megatron/core/optimizer_param_scheduler.py"

_INIT = "        self.optimizer = optimizer\n"
_RECORD = (
    "        # Each param group's max_lr / min_lr as this run built them: with\n"
    "        # override_opt_param_scheduler they are given back after a checkpoint replaced the groups.\n"
    "        self.built_group_lrs = [\n"
    "            {key: group.get(key) for key in ('max_lr', 'min_lr')} for group in optimizer.param_groups\n"
    "        ]\n"
)
# Right after the load has stepped the groups. Under the override the weight-decay fields restored
# after it keep this run's values, so the groups set here stay right; the end of the method is left
# to scheduler-checkpoint-wd's diff (the two diffs compose).
_STEPPED = "        self.step(increment=num_steps)\n"
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
    return [insert_after(TARGET, _INIT, _RECORD), insert_after(TARGET, _STEPPED, _RESTORE)]
