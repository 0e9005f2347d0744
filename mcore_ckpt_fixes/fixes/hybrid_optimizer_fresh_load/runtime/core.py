"""hybrid-optimizer-fresh-load in a job: the layers and the probes. Imported only once
``megatron.core.optimizer.distrib_optimizer`` (or ``megatron.training.checkpointing``) is; it imports
neither, nor ``megatron.training``: the layers find their targets by name. Why: doc.md.

With ``--optimizer-cpu-offload`` the hybrid optimizer steps its own copies of its parameters (fp32
copies of bf16 ones, CPU clones of parameters on the GPU), and without the precision-aware
optimizer its parameters are the distributed optimizer's fp32 main shards, copies of the model's
weights too. A load of the model's weights without the optimizer's state must refresh both, else
the first step writes the stale values back into the model. The release refreshes only
``param_to_fp32_param`` (0.12: nothing), and ``load_checkpoint`` asks for no refresh in an fp32 run.
"""

from __future__ import annotations

import sys
import types

import torch

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, FUNCTION, ID, MODULE, TRAINING

HYBRID = "HybridDeviceOptimizer"


def _hybrid_class():
    return sys.modules[MODULE].__dict__.get(HYBRID)


def _precision_aware(dist_opt) -> bool:
    """The release's own test for "the optimizer holds the main parameters" (0.12: the plain field)."""
    config = dist_opt.config
    return bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", config.use_precision_aware_optimizer))


def refresh_main_shards(dist_opt) -> None:
    """Each fp16/bf16 model parameter's fp32 main shard from the model's own shard (the release's
    views ``shard_float16_groups``). Quantized parameters (no plain view: ``None``) keep what the
    release gave them. From the model, with ``--load-main-params-from-ckpt`` too: as the release
    refreshes the hybrid optimizer under the precision-aware optimizer."""
    groups = zip(dist_opt.shard_float16_groups, dist_opt.shard_fp32_from_float16_groups)
    for shards, mains in groups:
        for shard, main in zip(shards, mains):
            if shard is not None and main is not None:
                main.data.copy_(shard)


def refresh_inner_copies(hybrid, lossless_only=False) -> None:
    """Each tensor the hybrid optimizer's sub-optimizers step (an fp32 copy, a CPU clone) from the
    parameter it stands for; ``lossless_only``: only the copies of the parameter's own dtype."""
    for group in hybrid.param_groups:
        for param in group["params"]:
            inner = hybrid.param_to_inner_param.get(param, param)
            if inner is param or (lossless_only and inner.dtype != param.dtype):
                continue
            with torch.no_grad():
                inner.copy_(param.detach())


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def copy_model_params_to_main_params(release, self, *args, **kwargs):
    """``DistributedOptimizer._copy_model_params_to_main_params`` (``reload_model_params``); with the
    hybrid optimizer, after the release's own copy: the main shards from the model (without the
    precision-aware optimizer, where they are the hybrid optimizer's parameters), then every copy
    its sub-optimizers step. With the precision-aware optimizer the second repeats the release's
    copy (the same conversion of the same values)."""
    out = release(self, *args, **kwargs)
    hybrid = _hybrid_class()
    if hybrid is None or not isinstance(self.optimizer, hybrid):
        return out
    if not _precision_aware(self):
        refresh_main_shards(self)
    refresh_inner_copies(self.optimizer)
    return out


def hybrid_optimizers(optimizer):
    """The hybrid optimizers inside what ``get_megatron_optimizer`` returned (chained or not)."""
    hybrid = _hybrid_class()
    found = []
    for dist_opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(dist_opt, "optimizer", None)
        if hybrid is not None and isinstance(inner, hybrid):
            found.append(inner)
    return found


@layer(ID, TRAINING, "load_checkpoint")
def load_checkpoint(release, ddp_model, optimizer, *args, **kwargs):
    """``megatron.training.checkpointing.load_checkpoint``: after the release's load, the hybrid
    optimizer's copies of the parameters' own dtype (fp32 parameters' CPU clones) from the
    parameters. An fp32 run asks for no ``reload_model_params`` where the optimizer's state is not
    loaded; where it is, they are equal already (nothing changes), and an fp16/bf16 parameter's
    fp32 copy is ``reload_model_params``' to refresh (never from the rounded parameter here)."""
    out = release(ddp_model, optimizer, *args, **kwargs)
    if optimizer is not None:
        for hybrid in hybrid_optimizers(optimizer):
            refresh_inner_copies(hybrid, lossless_only=True)
    return out


# -- probes: the release's own refresh on an inert hybrid optimizer ----------------------------------


class _DistOpt:
    """Just what ``_copy_model_params_to_main_params`` reads of a distributed optimizer (no
    precision-aware optimizer) whose hybrid optimizer steps a CPU clone of one parameter: a bf16
    parameter's fp32 main shard (``float16``: model, shard, main) or an fp32 parameter's shard
    (``fp32``: model, shard)."""

    def __init__(self, hybrid, float16=None, fp32=None):
        self.optimizer = hybrid
        self.config = types.SimpleNamespace(
            use_precision_aware_optimizer=False, use_precision_aware_optimizer_no_fp8_or_ds_fp8=False
        )
        self.ddp_config = types.SimpleNamespace(use_custom_fsdp=False, use_megatron_fsdp=False)
        model, shard, main = float16 or ([], [], [])
        self.model_float16_groups, self.shard_float16_groups, self.shard_fp32_from_float16_groups = (
            [[model]] if float16 else [[]],
            [[shard]] if float16 else [[]],
            [[main]] if float16 else [[]],
        )
        self.model_fp32_groups, self.shard_fp32_groups = ([[fp32[0]]], [[fp32[1]]]) if fp32 else ([[]], [[]])

    def _get_model_param_range_map(self, param):
        return {"param": types.SimpleNamespace(start=0, end=param.numel(), size=param.numel())}

    def _is_distopt_quantized_param(self, param):
        return False


def _inert_hybrid(cls, param, inner):
    """A hybrid optimizer object (its constructor is never run) with one parameter and its copy."""
    hybrid = cls.__new__(cls)
    hybrid.param_groups = [{"params": [param]}]
    hybrid.param_to_fp32_param = {param: inner} if inner.dtype != param.dtype else {}
    hybrid.gpu_params_map_cpu_copy = {param: inner}
    hybrid.param_to_inner_param = {param: inner}
    return hybrid


def release_leaves_copy_stale(module, fp32=False) -> bool:
    """After the release's ``_copy_model_params_to_main_params`` over a model reloaded with new
    weights (bf16, or ``fp32``), does the hybrid optimizer step anything but those weights?"""
    cls = module.__dict__[HYBRID]
    if fp32:
        model = torch.full((4,), 2.0)
        clone = torch.zeros(4)  # the CPU clone as built over the weights before the load
        dist_opt = _DistOpt(_inert_hybrid(cls, model.view(-1), clone), fp32=(model, model.view(-1)))
        original(module.__dict__[CLASS], FUNCTION)(dist_opt)
        return not torch.equal(clone, model)
    model = torch.full((4,), 2.0, dtype=torch.bfloat16)
    main = torch.zeros(4)  # the main shard (and its clone) as built over the weights before the load
    clone = main.clone()
    dist_opt = _DistOpt(_inert_hybrid(cls, main, clone), float16=(model, model.view(-1), main))
    original(module.__dict__[CLASS], FUNCTION)(dist_opt)
    return not (torch.equal(main, model.float()) and torch.equal(clone, model.float()))


def _optimizer_module():
    """The distributed optimizer's module, if it has what the probes run."""
    import importlib

    module = importlib.import_module(MODULE)
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in cls.__dict__ or HYBRID not in module.__dict__:
        return None
    return module


def probe(module: types.ModuleType):
    if _optimizer_module() is None:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} or no {HYBRID}"
    if not release_leaves_copy_stale(module):
        return False, f"{CLASS}.{FUNCTION} refreshes the hybrid optimizer's main shards and their copies"
    return True, (
        f"{CLASS}.{FUNCTION} leaves the hybrid optimizer's main shards and their CPU copies as built: "
        "after a load of the model alone the first step writes the old weights back"
    )


def probe_training(module: types.ModuleType):
    """An fp32 run: ``load_checkpoint`` reloads the model params (its gate reads
    ``optimizer_cpu_offload``) and the refresh reaches an fp32 parameter's CPU copy, or neither."""
    if "load_checkpoint" not in module.__dict__:
        return None, f"{TRAINING} has no load_checkpoint"
    optimizer_module = _optimizer_module()
    if optimizer_module is None:
        return None, f"{MODULE} has no {CLASS}.{FUNCTION} or no {HYBRID}"
    names = original(module, "load_checkpoint").__code__.co_names
    if "reload_model_params" not in names:
        return None, "load_checkpoint calls no reload_model_params: code this probe cannot judge, left alone"
    if "optimizer_cpu_offload" not in names:
        return True, (
            "load_checkpoint reloads no model params in an fp32 run, and the hybrid optimizer's CPU copies "
            "of fp32 parameters keep their old values: after --no-load-optim / --finetune the first step "
            "writes the old weights back"
        )
    if release_leaves_copy_stale(optimizer_module, fp32=True):
        return True, (
            f"load_checkpoint reloads the model params under --optimizer-cpu-offload, but {CLASS}.{FUNCTION} "
            "leaves an fp32 parameter's CPU copy as built"
        )
    return False, (
        f"load_checkpoint reloads the model params under --optimizer-cpu-offload and {CLASS}.{FUNCTION} "
        "refreshes an fp32 parameter's CPU copy"
    )
