"""dist-optim-mixed-dtype-order's monkeypatch on ``megatron.core.optimizer.distrib_optimizer``: a
wrapper of the classmethod ``DistributedOptimizer._build_optimizer_group_ranges``, the probe and
apply. Why: the package's docstring. Imported only when the target module is.

The wrapper runs the release's method, then orders each group's parameters as
``_build_model_and_main_param_groups`` will order their shards in the optimizer's group (the fp32
parameters first, then the others, each in the order the release listed them) and numbers the
parameter -> (group, order) map in that order. ``_build_model_and_main_param_groups`` walks the
group's parameters in that same order, so its model and shard groups, and the optimizer's group, are
what the release builds; only the map changes, and only for a group of mixed dtypes.
"""

from __future__ import annotations

import types

from ....engine.patching import MARK, Patcher, original
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
METHOD = "_build_optimizer_group_ranges"
BUILD_GROUPS = "_build_model_and_main_param_groups"
# The release's test for an fp32 parameter in _build_model_and_main_param_groups: such a parameter's
# shard goes first in the optimizer's group; every other parameter's (fp16/bf16) after.
FP32_TYPE = "torch.cuda.FloatTensor"


def _release(cls):
    return original(cls, METHOD).__func__  # a classmethod: the function under it


def number_as_the_optimizer_holds(param_group_map, group_ranges) -> None:
    """Order each group's parameters fp32 first (stable) and renumber ``param_group_map`` to match,
    in place: the order is then the optimizer group's order of their shards."""
    for group_index, group_range in enumerate(group_ranges):
        params = group_range["params"]
        fp32 = [p for p in params if p.type() == FP32_TYPE]
        params[:] = fp32 + [p for p in params if p.type() != FP32_TYPE]
        for order, param in enumerate(params):
            param_group_map[param] = (group_index, order)


def build_optimizer_group_ranges(cls, param_groups, gbuf_ranges):
    """``DistributedOptimizer._build_optimizer_group_ranges``, each parameter numbered at the place
    its shard will have in the optimizer's group."""
    param_group_map, group_ranges = _release(cls)(cls, param_groups, gbuf_ranges)
    number_as_the_optimizer_holds(param_group_map, group_ranges)
    return param_group_map, group_ranges


setattr(build_optimizer_group_ranges, MARK, ID)
REPLACEMENT = classmethod(build_optimizer_group_ranges)
setattr(REPLACEMENT, MARK, ID)


# -- probe: the release's own two methods on a bf16 and an fp32 inert parameter ------------------------


def release_mispairs(module) -> bool:
    """Does the release's map point an fp32 parameter that follows a bf16 one in the gradient buffer
    at another shard than its own (its shard is a view of its storage)?"""
    import torch

    class _OnDevice(torch.nn.Parameter):
        def type(self, *args, **kwargs):  # the release sorts parameters by their CUDA type name
            if args or kwargs:
                return super().type(*args, **kwargs)
            return "torch.cuda.BFloat16Tensor" if self.dtype == torch.bfloat16 else FP32_TYPE

    half, full = _OnDevice(torch.zeros(4, dtype=torch.bfloat16)), _OnDevice(torch.zeros(4))
    param_map = {p: {"param": module.Range(0, 4)} for p in (half, full)}
    gbuf_ranges = [{torch.float32: [{"param_map": param_map}]}]
    config = types.SimpleNamespace(
        use_precision_aware_optimizer=False,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
        optimizer_cpu_offload=False,
        fp8_recipe=None,
    )
    cls = module.__dict__[CLASS]
    param_group_map, ranges = _release(cls)(cls, [{"params": [half, full]}], gbuf_ranges)
    getattr(cls, BUILD_GROUPS)(gbuf_ranges, {p: (0, torch.float32, 0) for p in (half, full)}, ranges, config)
    group_index, order = param_group_map[full]
    shard = ranges[group_index]["orig_group"]["params"][order]
    return shard.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__ or not hasattr(cls, BUILD_GROUPS):
        return None, f"{MODULE} has no {CLASS}.{METHOD}"
    if not release_mispairs(module):
        return False, f"{CLASS}.{METHOD} numbers each parameter at its own shard in the optimizer's group"
    return True, (
        f"{CLASS}.{METHOD} numbers parameters in gradient-buffer order, the optimizer's group holds fp32 "
        "shards first: with mixed dtypes in a group, checkpoints pair parameters with other shards"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.__dict__[CLASS], METHOD, REPLACEMENT)
