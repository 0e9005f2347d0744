"""hybrid-optimizer-fp32-shards' monkeypatch on ``megatron.core.optimizer.distrib_optimizer``: a
wrapper of the classmethod ``DistributedOptimizer._build_model_and_main_param_groups``, the probe
and apply. Why: the package's docstring. Imported only when the target module is.

The wrapper runs the release's method and, with ``optimizer_cpu_offload``, puts a leaf view of the
same storage in place of each fp32 shard the release made a non-leaf view, in the two lists that
hold it: the distributed optimizer's ``shard_fp32_groups`` (through which it hands the shard its
gradient and copies its value) and the optimizer's parameter group (``orig_group``, which the
hybrid optimizer is rebuilt over). Without cpu offload the release's groups are returned unchanged.
"""

from __future__ import annotations

import types

from ....engine.patching import MARK, Patcher, below, original
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
METHOD = "_build_model_and_main_param_groups"
SHARD_FP32_GROUPS = 3  # the method's returned tuple: (model_float16, model_fp32, shard_float16, shard_fp32, ...)


def _release(cls):
    return original(cls, METHOD).__func__  # a classmethod: the function under it


def leaf_view(shard):
    """The same elements of the same storage as ``shard``, as a tensor autograd does not track (a
    leaf, which torch's optimizers accept), with the attributes the release set on the view
    (tensor-parallel attributes, ``shared``)."""
    leaf = shard.detach()
    leaf.__dict__.update(shard.__dict__)
    return leaf


def detach_fp32_shards(shard_fp32_groups, opt_group_ranges) -> None:
    """Replace each non-leaf fp32 shard by its :func:`leaf_view` wherever the release put it: both
    lists must hold the one object, since the distributed optimizer sets the gradient on the shard of
    ``shard_fp32_groups`` and the optimizer reads it from its own parameter."""
    for shards, group_range in zip(shard_fp32_groups, opt_group_ranges):
        params = group_range["orig_group"]["params"]
        for i, shard in enumerate(shards):
            if shard.is_leaf:
                continue
            leaf = shards[i] = leaf_view(shard)
            for j, param in enumerate(params):
                if param is shard:
                    params[j] = leaf


def build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    """``DistributedOptimizer._build_model_and_main_param_groups``; with ``optimizer_cpu_offload``
    (the hybrid optimizer, rebuilt over the shards by torch's ``Optimizer`` constructor) the fp32
    shards are leaf views of their parameters' storage."""
    groups = below(ID, cls, METHOD).__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
    if getattr(config, "optimizer_cpu_offload", False):
        detach_fp32_shards(groups[SHARD_FP32_GROUPS], opt_group_ranges)
    return groups


setattr(build_model_and_main_param_groups, MARK, ID)
REPLACEMENT = classmethod(build_model_and_main_param_groups)
setattr(REPLACEMENT, MARK, ID)


# -- probe: the release's own method on one inert fp32 parameter -------------------------------------


def release_gives_non_leaf_fp32_shard(module) -> bool:
    """Does the release's method give an fp32 parameter's shard as a view autograd tracks (which
    torch's ``Optimizer`` constructor refuses)?"""
    import torch

    class _OnDevice(torch.nn.Parameter):
        def type(self, *args, **kwargs):  # the method sorts parameters by their CUDA type name
            return "torch.cuda.FloatTensor" if not args and not kwargs else super().type(*args, **kwargs)

    param = _OnDevice(torch.zeros(4))
    gbuf_ranges = [{torch.float32: [{"param_map": {param: {"param": module.Range(0, 4)}}}]}]
    config = types.SimpleNamespace(
        use_precision_aware_optimizer=True,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=True,
        optimizer_cpu_offload=True,
        fp8_recipe=None,
    )
    ranges = [{"params": [param], "orig_group": {"params": [param]}}]
    cls = module.__dict__[CLASS]
    groups = _release(cls)(cls, gbuf_ranges, {param: (0, torch.float32, 0)}, ranges, config)
    (shard,) = groups[SHARD_FP32_GROUPS][0]
    return not shard.is_leaf


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__ or not hasattr(module, "HybridDeviceOptimizer"):
        return None, f"{MODULE} has no {CLASS}.{METHOD} or no HybridDeviceOptimizer"
    if not release_gives_non_leaf_fp32_shard(module):
        return False, f"{CLASS}.{METHOD} gives fp32 shards the optimizer constructor accepts (leaf views)"
    return True, (
        f"{CLASS}.{METHOD} gives fp32 shards as non-leaf views of the parameters: rebuilding "
        "HybridDeviceOptimizer over them raises ValueError"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.__dict__[CLASS], METHOD, REPLACEMENT)
