"""float16-optim-fp32-params in a job: the layer on ``Float16OptimizerWithFloat16Params.sharded_state_dict``
and the probe. Why: the package's docstring, in full: doc.md."""

from __future__ import annotations

import sys
import types
from itertools import chain

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, ID, METHOD, MODULE

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, above Float16OptimizerWithFloat16Params.


def _model_params_in_optimizer_order(optimizer):
    """The model parameter behind each parameter of ``optimizer`` (a
    Float16OptimizerWithFloat16Params), in the order torch numbers its state: a 16-bit parameter for
    its fp32 copy, any other parameter (fp32, or one without a gradient) for itself."""
    model_param_of = {
        id(main): model
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
        for model, main in zip(model_group, main_group)
    }
    return [
        model_param_of.get(id(param), param) for group in optimizer.optimizer.param_groups for param in group["params"]
    ]


def _fp32_copy_ids(optimizer, state_groups):
    """Per param group, the state ids (from the optimizer's state dict, ``state_groups``) of its
    16-bit parameters' fp32 copies, in the order of ``fp32_from_float16_groups``."""
    copies = {id(main) for main in chain.from_iterable(optimizer.fp32_from_float16_groups)}
    return [
        [param_id for param, param_id in zip(group["params"], state_group["params"]) if id(param) in copies]
        for group, state_group in zip(optimizer.optimizer.param_groups, state_groups)
    ]


# -- end of replacement ---


def only_fp32_copies(optimizer) -> bool:
    """Whether every parameter of the optimizer's groups is a 16-bit parameter's fp32 copy, in the
    order of ``fp32_from_float16_groups``: the one case the release numbers its state right."""
    params = [param for group in optimizer.optimizer.param_groups for param in group["params"]]
    copies = list(chain.from_iterable(optimizer.fp32_from_float16_groups))
    return len(params) == len(copies) and all(a is b for a, b in zip(params, copies))


@layer(ID, MODULE, METHOD, owner=CLASS)
def sharded_state_dict(below_us, self, model_sharded_state_dict, is_loading=False, *args, **kwargs):
    """The release's request where its groups hold 16-bit parameters' copies only; otherwise the same
    request with each state id paired with its own parameter (:func:`_model_params_in_optimizer_order`)."""
    if getattr(self, "is_stub_optimizer", False) or only_fp32_copies(self):
        return below_us(self, model_sharded_state_dict, is_loading, *args, **kwargs)
    if is_loading:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    model_params = _model_params_in_optimizer_order(self)
    id_to_sharded_param_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    # 0.19's GTP parameters, matched as the release matches them, by their state ids in that order.
    backfill = vars(sys.modules[MODULE]).get("_backfill_gtp_sharded_param_map")
    if backfill is not None:
        backfill(id_to_sharded_param_map, [model_params], model_sharded_state_dict)
    state_groups = state_dict["optimizer"]["param_groups"]
    state_dict["fp32_from_fp16_params"] = [
        [
            make_sharded_optimizer_tensor(id_to_sharded_param_map[param_id], copy, prefix="optimizer.state.fp32_param")
            for param_id, copy in zip(ids, copies)
        ]
        for ids, copies in zip(_fp32_copy_ids(self, state_groups), self.fp32_from_float16_groups)
    ]
    step = self._extract_common_per_param_step(state_dict["optimizer"])
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
    if step:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


# -- probe: the release's method on a stand-in optimizer ---------------------------------------------


def stand_in(cls):
    """An instance of the release's class over two parameters, a bf16 one (its fp32 copy in the
    group) and an fp32 one, each with SGD momentum, built without ``__init__`` (which asks for CUDA
    tensors): the attributes ``sharded_state_dict`` reads, set as ``__init__`` sets them."""
    half, single = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(3))
    main = half.detach().clone().float()
    inner = torch.optim.SGD([main, single], lr=0.1, momentum=0.9)
    for param in (main, single):
        inner.state[param]["momentum_buffer"] = torch.zeros_like(param)
    optimizer = object.__new__(cls)
    optimizer.optimizer, optimizer.config, optimizer.grad_scaler = inner, None, None
    optimizer.init_state_fn, optimizer.is_stub_optimizer = (lambda *args: None), False
    optimizer.float16_groups, optimizer.fp32_from_float16_groups = [[half]], [[main]]
    optimizer.fp32_from_fp32_groups = [[single]]
    model = {name: ShardedTensor.from_rank_offsets(name, param) for name, param in (("half", half), ("single", single))}
    return optimizer, model


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{METHOD}"
    optimizer, model = stand_in(cls)
    try:
        state = original(cls, METHOD)(optimizer, model)
    except ValueError as exc:
        if "does not match any model sharded param" not in str(exc):
            raise
        return True, f"{CLASS}.{METHOD} numbers its state from the 16-bit parameters alone: {exc}"
    keys = {param_id: entry["momentum_buffer"].key for param_id, entry in state["optimizer"]["state"].items()}
    if keys == {0: "optimizer.state.momentum_buffer.half", 1: "optimizer.state.momentum_buffer.single"}:
        return False, f"{CLASS}.{METHOD} pairs the state of an fp32 parameter with that parameter"
    return None, f"{CLASS}.{METHOD} could not be judged: it paired the state as {keys}"
