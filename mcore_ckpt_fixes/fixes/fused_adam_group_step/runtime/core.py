"""fused-adam-group-step in a job: the layer on ``DistributedOptimizer.load_state_dict`` and the
probe. Why: the package's docstring and doc.md.

Apex's and Transformer Engine's FusedAdam keep one ``step`` per param group, made at the group's
first step and advanced only where the group holds parameters; so on one rank every non-empty group
has the same step. A saved group without one while the others have a step was written from a rank
where it was empty (Megatron-Core <= 0.13 writes the groups as they are); the step it had on the
ranks that hold its parameters is the one every other group has.
"""

from __future__ import annotations

import logging
import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import with_globals
from .. import FUNCTION, ID, MODULE

CLASS = "DistributedOptimizer"
LOG = logging.getLogger("mcore_ckpt_fixes")


def with_group_steps(state_dict):
    """``state_dict`` where its param groups disagree only in that some have no step: a copy whose
    groups without one take the one step the others share. Anything else (no group has a step, the
    steps differ, no param groups) is returned as it is, the same object."""
    inner = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list):
        return state_dict
    steps = [group["step"] for group in groups if "step" in group]
    missing = [index for index, group in enumerate(groups) if "step" not in group]
    if not missing or not steps or any(not _same(step, steps[0]) for step in steps):
        return state_dict
    LOG.debug("%s: saved param groups %s had no step; given the other groups' step %s", ID, missing, steps[0])
    filled = [group if "step" in group else {**group, "step": steps[0]} for group in groups]
    return {**state_dict, "optimizer": {**inner, "param_groups": filled}}


def _fused_adam_path(self) -> bool:
    """The release took Apex's or Transformer Engine's FusedAdam (a step per param group), and this
    is not the CPU-offload hybrid optimizer (whose saved step is its CPU AdamW's)."""
    module = sys.modules[MODULE]
    hybrid = getattr(module, "HybridDeviceOptimizer", None)
    on_hybrid = isinstance(hybrid, type) and isinstance(getattr(self, "optimizer", None), hybrid)
    return bool(getattr(module, "HAVE_APEX_OR_TE", False)) and not on_hybrid


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of another shape: not one step
        return False


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """``DistributedOptimizer.load_state_dict`` on the saved groups, each with its step."""
    return below_us(self, with_group_steps(state_dict))


@layer(ID, MODULE, "state_dict", owner=CLASS)
def state_dict(below_us, self):
    """``DistributedOptimizer.state_dict``, each saved group on the one step of this rank's non-empty
    groups (as 0.14+ save them; up to 0.13 a group empty here kept no step, or the stale one a load
    gave it, and this rank may be the one whose groups the checkpoint keeps)."""
    out = below_us(self)
    if not _fused_adam_path(self):
        return out  # torch's Adam and the hybrid optimizer: the release writes their step itself
    inner = out.get("optimizer") if isinstance(out, dict) else None
    saved = inner.get("param_groups") if isinstance(inner, dict) else None
    live = getattr(getattr(self, "optimizer", None), "param_groups", None)
    if not isinstance(saved, list) or not isinstance(live, list) or len(saved) != len(live):
        return out
    steps = [group["step"] for group in live if group.get("params") and "step" in group]
    if not steps or any(not _same(step, steps[0]) for step in steps):
        return out  # before the first step, or steps the release would refuse (0.14+ asserts)
    if all("step" in group and _same(group["step"], steps[0]) for group in saved):
        return out
    inner["param_groups"] = [{**group, "step": steps[0]} for group in saved]
    return out


# -- probe: the release's own load on an inert stand-in ---------------------------------------------


class _Loaded(Exception):
    """Raised by the stand-in's inner optimizer with what the release handed it."""

    def __init__(self, param_groups):
        super().__init__("probe done")
        self.param_groups = param_groups


def _group(wd_mult, **extra):
    # The keys releases match saved groups by (0.14+); 0.12-0.13 match them by position.
    return dict(wd_mult=wd_mult, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False, lr=1e-3, **extra)


def _inner_optimizer():
    groups = [_group(1.0, params=[0]), _group(0.0, params=[1])]

    def load(state_dict):
        raise _Loaded(state_dict["param_groups"])

    return types.SimpleNamespace(
        state={0: {}},  # not empty: the release keeps this state instead of allocating one
        param_groups=groups,
        state_dict=lambda: {"state": {0: {}, 1: {}}, "param_groups": [dict(g) for g in groups]},
        load_state_dict=load,
    )


def release_gives_group_no_step(module) -> bool:
    """Run the release's load, on its FusedAdam path, with two saved groups, the second without a
    step: does the inner FusedAdam receive that group still without one?"""
    release = with_globals(original(getattr(module, CLASS), FUNCTION), HAVE_APEX_OR_TE=True)
    stand_in = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_megatron_fsdp=False, use_custom_fsdp=False),
        optimizer=_inner_optimizer(),
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
    )
    try:
        release(stand_in, {"optimizer": {"param_groups": [_group(1.0, step=5), _group(0.0)]}})
    except _Loaded as loaded:
        return "step" not in loaded.param_groups[1]
    raise RuntimeError("the release's load did not reach the inner optimizer's load_state_dict")


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__ or "HAVE_APEX_OR_TE" not in vars(module):
        return None, f"{MODULE} has no DistributedOptimizer.load_state_dict on a FusedAdam path"
    if release_gives_group_no_step(module):
        return True, (
            "a saved FusedAdam param group without a step (written by <= 0.13 from a rank where it is "
            "empty) reaches the optimizer without one: it restarts at step 1"
        )
    return False, "a saved param group without a step is given the other groups' step"
