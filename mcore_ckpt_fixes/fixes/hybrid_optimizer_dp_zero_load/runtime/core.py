"""hybrid-optimizer-dp-zero-load in a job: the layers on ``HybridDeviceOptimizer.dummy_step`` and
``DistributedOptimizer.load_parameter_state_from_dp_zero``, and their probes. Why: doc.md.

A resume from the legacy ``torch`` format loads the model first, then the optimizer: on a fresh
hybrid optimizer ``DistributedOptimizer.load_state_dict`` runs ``dummy_step`` to create its state,
a real step on random gradients whose post-step hooks copy the optimizer's own copies into the
parameters it holds (the model's shards, or the fp32 main shards). A dummy step exists only to
create state: here it leaves those parameters as it found them. Then the dp_zero load puts the saved
master parameters and moments into the hybrid optimizer's ``state`` alone; the release's other loads
hand them on to the sub-optimizers (``_sync_hdo_state_to_sub_optimizers``), and so does this one here.
"""

from __future__ import annotations

import sys
import types

import torch

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, DIST_CLASS, DIST_MODULE, DP_ZERO, FUNCTION, ID, MODULE

SYNC = "_sync_hdo_state_to_sub_optimizers"
SET_STATE = "_set_main_param_and_optimizer_states"  # how the dp_zero load writes into the hybrid state


def _hybrid_class():
    """The release's HybridDeviceOptimizer, where its module is imported (None before)."""
    return sys.modules[MODULE].__dict__.get(CLASS) if MODULE in sys.modules else None


def _parameters(hybrid):
    return [param for group in hybrid.param_groups for param in group["params"]]


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def dummy_step(release, self, *args, **kwargs):
    """``HybridDeviceOptimizer.dummy_step``: the release's step (the optimizer's state is created),
    then its parameters get back the values they had before it. One copy of the parameters, on their
    device, held for the length of the step (a load's, once)."""
    params = _parameters(self)
    kept = [param.detach().clone() for param in params]
    out = release(self, *args, **kwargs)
    with torch.no_grad():
        for param, value in zip(params, kept):
            param.copy_(value)
    return out


@layer(ID, DIST_MODULE, DP_ZERO, owner=DIST_CLASS)
def load_parameter_state_from_dp_zero(release, self, *args, **kwargs):
    """``DistributedOptimizer.load_parameter_state_from_dp_zero``; with the hybrid optimizer, the
    loaded state is handed to its sub-optimizers (their fp32 copies set from the loaded master
    parameters), as the release's fully_reshardable and fully_sharded_model_space loads do."""
    out = release(self, *args, **kwargs)
    hybrid = _hybrid_class()
    if hybrid is not None and isinstance(getattr(self, "optimizer", None), hybrid):
        getattr(self.optimizer, SYNC)()
    return out


# -- probes ------------------------------------------------------------------------------------------


def release_dummy_step_moves(cls) -> bool:
    """The release's ``dummy_step`` on a hybrid optimizer whose step writes its parameters (lr 0.1,
    as the copy-back hooks write the stepped copies): does a parameter change? Run on the default
    generator's own state, given back after (the release draws random gradients)."""

    class Stepping(cls):
        def __init__(self):
            self.param_groups = [{"params": [torch.zeros(4)], "lr": 0.1}]

        def step(self, closure=None):
            for group in self.param_groups:
                for param in group["params"]:
                    param.data.add_(param.grad, alpha=-group["lr"])

        def zero_grad(self, set_to_none=True):
            for param in _parameters(self):
                param.grad = None

    hybrid = Stepping()
    with torch.random.fork_rng(devices=[]):
        original(cls, FUNCTION)(hybrid)
    return bool(_parameters(hybrid)[0].any())


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION}"
    if not release_dummy_step_moves(cls):
        return False, f"{CLASS}.{FUNCTION} leaves the parameters as they were"
    return True, (
        f"{CLASS}.{FUNCTION} steps the parameters on random gradients: a load of the legacy torch format "
        "copies the optimizer's stale copies into the model it has just loaded"
    )


def probe_dp_zero(module: types.ModuleType):
    """Read in the code: a dp_zero load needs a gloo process group, which a probe at import has not.
    Does the release's ``load_parameter_state_from_dp_zero``, which writes the loaded state through
    ``_set_main_param_and_optimizer_states``, call the sync the other loads call? (A sync it reaches
    another way would be repeated by the layer: the same values again.)"""
    cls = module.__dict__.get(DIST_CLASS)
    hybrid = _hybrid_class()
    if cls is None or DP_ZERO not in cls.__dict__ or hybrid is None or SYNC not in hybrid.__dict__:
        return None, f"{DIST_MODULE} has no {DIST_CLASS}.{DP_ZERO}, or {CLASS} no {SYNC}"
    names = original(cls, DP_ZERO).__code__.co_names
    if SET_STATE not in names:
        return None, f"{DIST_CLASS}.{DP_ZERO} calls no {SET_STATE}: code this probe cannot judge, left alone"
    if SYNC in names:
        return False, f"{DIST_CLASS}.{DP_ZERO} hands the loaded state to the hybrid optimizer's sub-optimizers"
    return True, (
        f"{DIST_CLASS}.{DP_ZERO} puts the loaded master parameters into the hybrid optimizer's state only: "
        "its sub-optimizers go on stepping copies of other values"
    )
