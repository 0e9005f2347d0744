"""scheduler-override-group-lr's monkeypatch on ``megatron.core.optimizer_param_scheduler``:
``OptimizerParamScheduler.__init__`` and ``load_state_dict`` wrapped, and the probe. Why: the
package's docstring. Imported only when the target module is.
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import CLASS, ID, MODULE

# The scheduler's record of each group's max_lr / min_lr as the run built them (None: absent).
BUILT = "_mcore_ckpt_fixes_built_group_lrs"
KEYS = ("max_lr", "min_lr")


def _release(name):
    return original(getattr(sys.modules[MODULE], CLASS), name)


def built_group_lrs(optimizer):
    return [{k: group.get(k) for k in KEYS} for group in optimizer.param_groups]


def restore_group_lrs(groups, built) -> None:
    """Each group's max_lr / min_lr as the run built them (a key it did not have is dropped, so the
    scheduler's own value applies again, as before the load)."""
    for group, values in zip(groups, built):
        for key, value in values.items():
            if value is None:
                group.pop(key, None)
            else:
                group[key] = value


@layer(ID, MODULE, "__init__", owner=CLASS)
def __init__(below_us, self, *args, **kwargs):
    """``OptimizerParamScheduler.__init__``, then the groups' max_lr / min_lr recorded: the values
    the run's own arguments gave them, before a checkpoint replaces the groups."""
    below_us(self, *args, **kwargs)
    setattr(self, BUILT, built_group_lrs(self.optimizer))


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """``OptimizerParamScheduler.load_state_dict``; with ``--override-opt-param-scheduler`` each group
    then gets its recorded max_lr / min_lr back and its lr / weight decay from them."""
    below_us(self, state_dict)
    built = getattr(self, BUILT, None)
    groups = self.optimizer.param_groups
    if self.override_opt_param_scheduler and built is not None and len(built) == len(groups):
        restore_group_lrs(groups, built)
        self.step(increment=0)  # lr and weight decay of every group, from the restored values


# -- probe: the release's own two methods on a stand-in optimizer, through a load ------------------


def _quiet(release):
    """The release's method without its per-value log lines (the probe runs in every process)."""
    return with_globals(release, log_single_rank=lambda *args, **kwargs: None)


def group_lr_after_override(module) -> tuple:
    """(the group's lr, the lr the new schedule gives) after a load with the override: the run built
    its group with max_lr 0.02, the checkpoint's group and scheduler say 0.01 (constant schedule)."""
    cls = module.__dict__[CLASS]
    init, load = original(cls, "__init__"), original(cls, "load_state_dict")  # the release's, fixed or not
    optimizer = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0, "max_lr": 0.02, "min_lr": 0.0}])

    def scheduler(max_lr, override):
        s = cls.__new__(cls)
        kwargs = dict(
            init_lr=0.0,
            max_lr=max_lr,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_steps=10,
            lr_decay_style="constant",
            start_wd=0.0,
            end_wd=0.0,
            wd_incr_steps=10,
            wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=not override,
            override_opt_param_scheduler=override,
        )
        _quiet(init)(s, optimizer, **kwargs)
        return s

    run = scheduler(0.02, True)
    saved = scheduler(0.01, False).state_dict()
    optimizer.param_groups = [{"lr": 0.01, "weight_decay": 0.0, "max_lr": 0.01, "min_lr": 0.0}]  # the loaded groups
    _quiet(load)(run, saved)
    return optimizer.param_groups[0]["lr"], 0.02


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or "load_state_dict" not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.load_state_dict"
    got, wanted = group_lr_after_override(module)
    if got != wanted:
        return True, (
            f"with --override-opt-param-scheduler a loaded param group keeps the checkpoint's max_lr "
            f"(lr {got} where the run's schedule gives {wanted})"
        )
    return False, "--override-opt-param-scheduler sets the loaded param groups' learning rate from the run's schedule"
