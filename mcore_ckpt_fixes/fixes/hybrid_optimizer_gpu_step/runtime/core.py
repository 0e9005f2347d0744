"""hybrid-optimizer-gpu-step in a job: the layer on
``HybridDeviceOptimizer._sync_hdo_param_groups_to_sub_optimizers`` and the probe. Why: doc.md.

The hybrid optimizer's param groups carry what the scheduler sets (``lr``, ``weight_decay``) and,
after a load, the checkpoint's ``step``; before each step the release copies all of it into the
sub-optimizers' groups. A FusedAdam counts its step in its group: copied again before every step,
the loaded value freezes its counter. Here the loaded ``step`` goes to the sub-optimizers once (the
release's copy right after the load) and is then taken out of the hybrid optimizer's groups.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, FUNCTION, ID, MODULE


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def sync_param_groups(release, self, *args, **kwargs):
    """The release's copy of the hybrid optimizer's group settings into its sub-optimizers; then a
    ``step`` there (a load's) is dropped: the sub-optimizers have it and count on from it."""
    out = release(self, *args, **kwargs)
    for group in self.param_groups:
        group.pop("step", None)
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
