"""scheduler-checkpoint-wd's monkeypatch on ``megatron.core.optimizer_param_scheduler``:
``OptimizerParamScheduler.load_state_dict`` wrapped, and the probe. Why: the package's docstring.
Imported only when the target module is.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import CLASS, ID, MODULE

# The scheduler's weight-decay fields: the release restores them after it has stepped the groups.
WD_FIELDS = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """``OptimizerParamScheduler.load_state_dict``, then, where the checkpoint carried the
    weight-decay fields, every group's lr and weight decay set again from the restored values.
    Where those equal the run's own (the release's load is right) this writes the same bits."""
    below_us(self, state_dict)
    if "start_wd" in state_dict:
        self.step(increment=0)


# -- probe: the release's own methods on a stand-in optimizer, through a load ---------------------


def _quiet(release):
    """The release's function without its per-value log lines (the probe runs in every process)."""
    return with_globals(release, log_single_rank=lambda *args, **kwargs: None)


def _quiet_class(cls):
    """``cls`` with its ``_check_and_set`` silenced too (the release's load logs each value there)."""
    check = cls.__dict__.get("_check_and_set")
    return type(cls.__name__, (cls,), {} if check is None else {"_check_and_set": _quiet(check)})


def group_wd_after_load(module, saved_wd=0.01, new_wd=0.05):
    """The group's weight decay after a load with the checkpoint's schedule: the checkpoint's
    scheduler says ``saved_wd``, the run's arguments ``new_wd`` (constant, no lr schedule to speak of).
    None where the release's scheduler saves no weight-decay fields."""
    cls = module.__dict__[CLASS]
    init, load = original(cls, "__init__"), original(cls, "load_state_dict")  # the release's, fixed or not
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0}])
    quiet = _quiet_class(cls)

    def scheduler(wd, use_checkpoint):
        s = quiet.__new__(quiet)
        kwargs = dict(
            init_lr=0.0,
            max_lr=0.01,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_steps=10,
            lr_decay_style="constant",
            start_wd=wd,
            end_wd=wd,
            wd_incr_steps=10,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=use_checkpoint,
            override_opt_param_scheduler=False,
        )
        _quiet(init)(s, optimizer, **kwargs)
        return s

    saved = scheduler(saved_wd, False)
    saved.step(increment=3)
    state = saved.state_dict()
    if "start_wd" not in state:
        return None
    run = scheduler(new_wd, True)
    optimizer.param_groups = [{"lr": 0.01, "weight_decay": saved_wd}]  # as the optimizer's load restores them
    _quiet(load)(run, state)
    return optimizer.param_groups[0]["weight_decay"]


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or "load_state_dict" not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.load_state_dict"
    saved, new = 0.01, 0.05
    got = group_wd_after_load(module, saved, new)
    if got is None:
        return None, f"{CLASS}.state_dict saves no weight-decay schedule"
    if got == new:
        return True, (
            "with --use-checkpoint-opt_param-scheduler the param groups leave the load with the new arguments' "
            f"weight decay ({got}; the checkpoint's is {saved}) for the first step"
        )
    if got == saved:
        return False, "the param groups leave the load with the checkpoint's weight decay"
    return None, f"a load gave the param group weight decay {got}, neither the checkpoint's nor the arguments'"
