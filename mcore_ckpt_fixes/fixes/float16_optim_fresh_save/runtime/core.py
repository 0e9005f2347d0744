"""float16-optim-fresh-save in a job: the layers on ``Float16OptimizerWithFloat16Params.sharded_state_dict``
(save side) and ``load_state_dict`` (load side), and the probe. Why: the package's docstring, in
full: doc.md."""

from __future__ import annotations

import logging
import types

import torch

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, ID, MODULE

log = logging.getLogger("mcore_ckpt_fixes")

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, above Float16OptimizerWithFloat16Params.


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _without_optimizer_state(optimizer) -> bool:
    """A Float16OptimizerWithFloat16Params that has taken no step and loaded nothing (no parameter
    has state: an fp16 run whose loss scaler has skipped every step so far), whose state is what
    ``init_state_fn`` creates (not the precision-aware optimizer's)."""
    if getattr(optimizer, "is_stub_optimizer", False) or getattr(optimizer, "init_state_fn", None) is None:
        return False
    if getattr(getattr(optimizer, "config", None), "use_precision_aware_optimizer", False):
        return False
    params = _optimizer_params(optimizer.optimizer)
    return bool(params) and not any(optimizer.optimizer.state.get(p) for p in params)


def _drop_optimizer_state(optimizer) -> None:
    """No parameter has state any more (a state dict built before keeps what it holds)."""
    for p in _optimizer_params(optimizer.optimizer):
        optimizer.optimizer.state.pop(p, None)


def _stepless_zero_moments(optimizer, saved) -> bool:
    """``saved`` (the optimizer part of a checkpoint) holds, for torch's Adam (a step count per
    parameter), zero moments and no step: what a save before the first step writes (a step of 0 is
    not saved), which torch's ``load_state_dict`` refuses without a step."""
    if not isinstance(optimizer.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return False
    entries = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(entries, dict) or not entries or "common_step" in entries:
        return False
    return all(
        isinstance(entry, dict)
        and set(entry) == {"exp_avg", "exp_avg_sq"}
        and all(torch.is_tensor(v) and not v.any() for v in entry.values())
        for entry in entries.values()
    )


def _loaded_before_first_step(optimizer) -> bool:
    """What the load restored is the state of an Adam that had not stepped: no step counted
    (FusedAdam counts in its param groups, torch's Adam per parameter) and every moment zero."""
    from megatron.core import optimizer as optimizer_package  # the Adam get_megatron_optimizer builds

    kinds = (torch.optim.Adam, torch.optim.AdamW, getattr(optimizer_package, "Adam", None))
    if getattr(optimizer, "is_stub_optimizer", False):
        return False
    if not isinstance(optimizer.optimizer, tuple(k for k in kinds if isinstance(k, type))):
        return False
    if any(group.get("step") for group in optimizer.optimizer.param_groups):
        return False
    states = [optimizer.optimizer.state.get(p) for p in _optimizer_params(optimizer.optimizer)]
    if not states or not all(states):
        return False
    for s in states:
        if not set(s) <= {"exp_avg", "exp_avg_sq", "step"}:
            return False
        if s.get("step") is not None and float(s["step"]) != 0.0:
            return False
        if any(s[k].any() for k in ("exp_avg", "exp_avg_sq") if k in s):
            return False
    return True


# -- end of replacement ---


@layer(ID, MODULE, "sharded_state_dict", owner=CLASS)
def sharded_state_dict(below_us, self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
    """The release's request; a save request (``is_loading=False``) of an optimizer without state
    describes the zero moments Adam starts from (the load request asks for them), and the optimizer
    is left without state after: training goes on exactly as without the save."""
    if is_loading or not _without_optimizer_state(self):
        return below_us(self, model_sharded_state_dict, is_loading, *args, **kwargs)
    self.init_state_fn(self.optimizer, self.config)
    try:
        return below_us(self, model_sharded_state_dict, is_loading, *args, **kwargs)
    finally:
        _drop_optimizer_state(self)


@layer(ID, MODULE, "load_state_dict", owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """The release's load; where what it restored is the state of an Adam that had not stepped (a
    checkpoint saved before its first step), the optimizer is left without state, as the run that
    saved it was: Adam creates the same zero moments at its first step. On torch's Adam such a
    checkpoint gets the step 0 it was saved at, which its ``load_state_dict`` needs."""
    saved = state_dict.get("optimizer") if isinstance(state_dict, dict) else None
    if _stepless_zero_moments(self, saved):
        saved["state"]["common_step"] = torch.tensor(0.0)
    result = below_us(self, state_dict)
    if _loaded_before_first_step(self):
        _drop_optimizer_state(self)
        log.debug("%s: a checkpoint saved before the optimizer's first step: no optimizer state kept", ID)
    return result


# -- probe: the release's save request of a never-stepped optimizer, on a stand-in ------------------


def _stand_in(cls):
    """An instance of the release's class over one bf16 parameter (its fp32 copy in Adam's group, no
    state yet), built without ``__init__`` (which asks for CUDA tensors): the attributes
    ``sharded_state_dict`` reads, set as ``__init__`` sets them."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    half = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    main = half.detach().clone().float()
    inner = torch.optim.Adam([main], lr=0.1)

    def init_state_fn(opt, config=None):
        for p in _optimizer_params(opt):
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    optimizer = object.__new__(cls)
    optimizer.optimizer, optimizer.config, optimizer.grad_scaler = inner, None, None
    optimizer.init_state_fn, optimizer.is_stub_optimizer = init_state_fn, False
    optimizer.float16_groups, optimizer.fp32_from_float16_groups = [[half]], [[main]]
    optimizer.fp32_from_fp32_groups = [[]]
    return optimizer, {"half": ShardedTensor.from_rank_offsets("half", half)}


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or "sharded_state_dict" not in cls.__dict__ or "load_state_dict" not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.sharded_state_dict / load_state_dict"
    optimizer, model = _stand_in(cls)
    saved = original(cls, "sharded_state_dict")(optimizer, model, is_loading=False)
    described = {k for entry in saved["optimizer"]["state"].values() if isinstance(entry, dict) for k in entry}
    if not described:
        return True, (
            f"{CLASS}.sharded_state_dict describes no Adam moments for an optimizer that has not stepped "
            f"(is_loading=False): a checkpoint saved before the first step cannot be loaded"
        )
    if {"exp_avg", "exp_avg_sq"} <= described:
        return False, f"{CLASS}.sharded_state_dict describes Adam's moments before the first step"
    return None, f"{CLASS}.sharded_state_dict could not be judged: it described {sorted(described)}"
