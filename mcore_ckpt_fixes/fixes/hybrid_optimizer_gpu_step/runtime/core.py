"""hybrid-optimizer-gpu-step in a job: the layers on
``HybridDeviceOptimizer._sync_hdo_param_groups_to_sub_optimizers`` and
``DistributedOptimizer.state_dict``, and their probes. Why: doc.md.

The hybrid optimizer's param groups carry what the scheduler sets (``lr``, ``weight_decay``) and,
after a load, the checkpoint's ``step``; before each step the release copies all of it into the
sub-optimizers' groups. A FusedAdam counts its step in its group: copied again before every step,
the loaded value freezes its counter. Here the loaded ``step`` goes to the sub-optimizers once (the
release's copy right after the load) and is then taken out of the hybrid optimizer's groups.

The distributed optimizer's ``state_dict`` saves the hybrid optimizer's step from its CPU
optimizers (torch's AdamW, a step per parameter): with nothing offloaded (offload fraction 0) there
is none, and no step is saved. Here the GPU FusedAdam's own group step is saved then.
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import CLASS, DIST_CLASS, DIST_MODULE, FUNCTION, ID, MODULE


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def sync_param_groups(release, self, *args, **kwargs):
    """The release's copy of the hybrid optimizer's group settings into its sub-optimizers; then a
    ``step`` there (a load's) is dropped: the sub-optimizers have it and count on from it."""
    out = release(self, *args, **kwargs)
    for group in self.param_groups:
        group.pop("step", None)
    return out


def gpu_only_step(hybrid):
    """The step to save for a hybrid optimizer whose CPU optimizers hold no state (none built, as
    with offload fraction 0, or none stepped): its GPU FusedAdam's group step; None where the CPU
    optimizers have one (the release saves theirs) or the GPU optimizer keeps none in its groups."""
    cls = sys.modules[MODULE].__dict__.get(CLASS) if MODULE in sys.modules else None
    gpu = getattr(hybrid, "gpu_optimizer", None)
    if cls is None or not isinstance(hybrid, cls) or gpu is None:
        return None
    if any(len(cpu.state) for cpu in hybrid.cpu_optimizers):
        return None
    steps = {group["step"] for group in gpu.param_groups if group["params"] and "step" in group}
    return int(steps.pop()) if len(steps) == 1 else None


@layer(ID, DIST_MODULE, "state_dict", owner=DIST_CLASS)
def state_dict(release, self, *args, **kwargs):
    """``DistributedOptimizer.state_dict``; where the release found no step in a hybrid optimizer's
    CPU optimizers, the GPU FusedAdam's is written into the saved param groups, as the release
    writes the CPU optimizers' (one step for every group)."""
    out = release(self, *args, **kwargs)
    step = gpu_only_step(getattr(self, "optimizer", None))
    if step is not None and "optimizer" in out:
        for group in out["optimizer"]["param_groups"]:
            group["step"] = step
    return out


# -- probe: the release's sync on an inert hybrid optimizer ------------------------------------------


class _SubOptimizer:
    """A FusedAdam as the sync sees it: param groups with a group-level step."""

    def __init__(self, param):
        self.param_groups = [{"params": [param], "lr": 0.1}]


def release_resets_the_step(cls) -> bool:
    """A hybrid optimizer (its constructor never run) whose group holds a loaded step 2, synced once
    (as after the load), its FusedAdam stepping once (3), synced again (the next step): is the
    FusedAdam's step back at 2?"""
    import torch

    param = torch.zeros(1)
    sub = _SubOptimizer(param)
    hybrid = cls.__new__(cls)
    hybrid.param_groups = [{"params": [param], "lr": 0.1, "step": 2}]
    hybrid.param_to_inner_param = {param: param}
    hybrid.cpu_optimizers, hybrid.gpu_optimizer = [], sub
    sync = original(cls, FUNCTION)
    sync(hybrid)
    sub.param_groups[0]["step"] += 1
    sync(hybrid)
    return sub.param_groups[0]["step"] == 2


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION}"
    if not release_resets_the_step(cls):
        return False, f"{CLASS}.{FUNCTION} leaves the sub-optimizers' step to count"
    return True, (
        f"{CLASS}.{FUNCTION} copies a loaded 'step' into the sub-optimizers before every step: a GPU "
        "FusedAdam's counter stays at the checkpoint's, Adam's bias correction frozen"
    )


# -- probe: the release's state_dict over a hybrid optimizer with nothing offloaded ------------------


def _gpu_only_hybrid(cls, step):
    """A hybrid optimizer (a subclass whose constructor builds nothing) with no CPU optimizer and a
    GPU FusedAdam at ``step``: what ``state_dict`` reads of it."""

    import torch

    class GpuOnly(cls):
        def __init__(self):
            param = torch.zeros(1)
            self.param_groups = [{"params": [param], "lr": 0.1}]
            self.cpu_optimizers, self.gpu_optimizer = [], _SubOptimizer(param)
            self.gpu_optimizer.param_groups[0]["step"] = step

        def state_dict(self):
            return {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]}

    return GpuOnly()


class _DistOpt:
    """What ``DistributedOptimizer.state_dict`` reads of itself: the inner optimizer, no grad scaler."""

    def __init__(self, optimizer):
        self.optimizer, self.grad_scaler = optimizer, None


def release_saves_no_step(module) -> bool:
    """The release's ``state_dict`` (on the FusedAdam path a GPU host takes: Apex or Transformer
    Engine found) over a hybrid optimizer stepped 3 times on the GPU alone: no step saved?"""
    names = {"HAVE_APEX_OR_TE": True, "USING_APEX_OPTIMIZER": True, "USING_TE_OPTIMIZER": False}
    release = original(module.__dict__[DIST_CLASS], "state_dict")
    present = {k: v for k, v in names.items() if k in release.__globals__}
    hybrid = _gpu_only_hybrid(sys.modules[MODULE].__dict__[CLASS], 3)
    saved = with_globals(release, **present)(_DistOpt(hybrid))
    return all(group.get("step") != 3 for group in saved["optimizer"]["param_groups"])


def probe_state_dict(module: types.ModuleType):
    cls = module.__dict__.get(DIST_CLASS)
    hybrid = sys.modules.get(MODULE)
    if cls is None or "state_dict" not in cls.__dict__ or hybrid is None or CLASS not in hybrid.__dict__:
        return None, f"{DIST_MODULE} has no {DIST_CLASS}.state_dict or {MODULE} no {CLASS}"
    if "HAVE_APEX_OR_TE" not in original(cls, "state_dict").__globals__:
        return (
            None,
            f"{DIST_CLASS}.state_dict's module has no HAVE_APEX_OR_TE: code this probe cannot judge, left alone",
        )
    if not release_saves_no_step(module):
        return (
            False,
            f"{DIST_CLASS}.state_dict saves the GPU FusedAdam's step of a hybrid optimizer with nothing offloaded",
        )
    return True, (
        f"{DIST_CLASS}.state_dict takes a hybrid optimizer's step from its CPU optimizers only: with nothing "
        "offloaded (offload fraction 0) no step is saved, and the resumed FusedAdam counts from 1"
    )
