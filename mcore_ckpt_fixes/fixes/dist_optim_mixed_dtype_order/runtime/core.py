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

from ....engine.patching import MARK, Patcher, below, original
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
    param_group_map, group_ranges = below(ID, cls, METHOD).__func__(cls, param_groups, gbuf_ranges)
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


# The release's methods checkpoint_mispairs runs: their originals, whatever fix wraps them.
RELEASE_METHODS = ("__init__", METHOD, BUILD_GROUPS, "_get_main_param_and_optimizer_states")


def checkpoint_mispairs(module) -> bool:
    """The outcome: does the release's own ``__init__`` (with whatever renumbering it does after
    building the groups, as upstream's #5835 does in ``__init__``) leave its checkpoint read path
    ``_get_main_param_and_optimizer_states`` handing an fp32 parameter that follows a bf16 one in
    the gradient buffers another parameter's main value? By value: bf16 1.0, fp32 2.0. Only what
    needs CUDA, real gradient buffers or a real optimizer is stood in for, by a probe subclass
    (nothing in the module is changed); the release's methods it runs are its originals."""
    import torch

    probe_cls, optimizer_cls, on_device = _stand_in_classes(module, torch)
    half = on_device(torch.full((4,), 1.0, dtype=torch.bfloat16))
    full = on_device(torch.full((4,), 2.0))
    ddp_config = types.SimpleNamespace(use_custom_fsdp=False, use_megatron_fsdp=False, use_distributed_optimizer=True)

    def buffer(param):  # a grad buffer holding one parameter, with no buckets
        key = (param.dtype, torch.float32)
        return types.SimpleNamespace(
            param_dtype=param.dtype,
            grad_dtype=torch.float32,
            buckets=[],
            params=[],
            ddp_config=ddp_config,
            range_map={key: [{"param_map": {param: {"param": module.Range(0, 4)}}}]},
        )

    config = types.SimpleNamespace(
        use_precision_aware_optimizer=False,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
        optimizer_cpu_offload=False,
        chunked_optimizer_state_offload=False,
        optimizer_state_offload_fraction=0.0,
        fp8_recipe=None,
        fp16=False,
        bf16=True,
    )
    inst = probe_cls(
        optimizer=optimizer_cls([{"params": [half, full]}]),
        config=config,
        grad_scaler=None,
        init_state_fn=None,
        model_chunks=[types.SimpleNamespace(ddp_config=ddp_config)],
        per_model_buffers={0: [buffer(half), buffer(full)]},  # bf16 first in the buffers
        data_parallel_group=None,
        data_parallel_group_gloo=None,
        data_parallel_group_idx=0,
        distributed_optimizer_instance_id=0,
    )
    for param in (half, full):
        main = inst._get_main_param_and_optimizer_states(param)["param"]
        if not torch.equal(main.float(), param.detach().float()):
            return True
    return False


def _stand_in_classes(module, torch):
    """The probe's subclass of the release's DistributedOptimizer (MixedPrecisionOptimizer's CUDA
    set-up skipped, gradient-buffer range maps given), an inner optimizer of the release's Adam type,
    and parameters that report CUDA type names."""
    cls = module.__dict__[CLASS]
    mixed_base = cls.__mro__[1]  # MixedPrecisionOptimizer

    class _OnDevice(torch.nn.Parameter):
        def type(self, *args, **kwargs):  # the release sorts parameters by their CUDA type name
            if args or kwargs:
                return super().type(*args, **kwargs)
            return "torch.cuda.BFloat16Tensor" if self.dtype == torch.bfloat16 else FP32_TYPE

    class _Optimizer(module.Adam):
        def __init__(self, params):
            torch.optim.Optimizer.__init__(self, params, {})

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    class _NoCudaInit(mixed_base):
        def __init__(self, optimizer, config, grad_scaler, init_state_fn):
            self.optimizer, self.config, self.grad_scaler = optimizer, config, grad_scaler
            self.init_state_fn = init_state_fn

    class _Probe(cls, _NoCudaInit):
        @classmethod
        def _build_gbuf_range_map(cls_, buffer):
            return buffer.range_map

    for name in RELEASE_METHODS:  # a wrapper that finds its original by class never sees _Probe
        if name in cls.__dict__:
            setattr(_Probe, name, original(cls, name))
    return _Probe, _Optimizer, _OnDevice


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__ or not hasattr(cls, BUILD_GROUPS):
        return None, f"{MODULE} has no {CLASS}.{METHOD}"
    try:
        # The outcome, where the release's __init__ runs on the stand-ins (every release wheel
        # 0.12-0.19.2 and upstream dev, which renumbers the map in __init__: #5835).
        mispairs, how = checkpoint_mispairs(module), ""
    except Exception as exc:  # an __init__ these stand-ins do not fit: the two methods alone
        mispairs, how = (
            release_mispairs(module),
            f" (judged on the map: __init__ did not run here, {type(exc).__name__})",
        )
    if not mispairs:
        return False, f"{CLASS} gives each parameter its own main value and state in checkpoints{how}"
    return True, (
        f"{CLASS}.{METHOD} numbers parameters in gradient-buffer order, the optimizer's group holds fp32 "
        f"shards first: with mixed dtypes in a group, checkpoints pair parameters with other shards{how}"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.__dict__[CLASS], METHOD, REPLACEMENT)
