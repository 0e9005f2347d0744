"""float16-optim-fp32-params' round trip: Megatron's DDP and the non-distributed mixed-precision
optimizer (``get_megatron_optimizer`` with bf16 and without the distributed optimizer:
``Float16OptimizerWithFloat16Params``, Adam on the path Megatron takes with Apex installed,
:mod:`mcore_ckpt_fixes.testing._fused_adam`'s CPU stand-in) over a model whose one parameter group
holds a bf16, an fp32 and a bf16 parameter, in that order (as a model that keeps some parameters
fp32 in a bf16 run hands them over), saved and loaded with ``dist_checkpointing`` on 2 gloo ranks
(DP=2).

Phases: ``save`` (``STEPS`` steps, then the model and the optimizer saved), ``load`` (a target run
with other initial values and one step of its own loads them), ``compare`` (each parameter, its fp32
main value (the bf16 parameters' copies; the fp32 parameter itself) and its Adam moments against
what was saved, then after one more step on both runs against the uninterrupted run's: ``next/``).

What is not real: the gradients (drawn, the same on every rank), Apex's FusedAdam (a stand-in in
plain torch ops) and, on a CPU host, the CUDA tensors (:mod:`mcore_ckpt_fixes.testing.dist_optimizer`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import SOURCE_SEED, optimizer_config, step, values, world
from ....testing.dist_optimizer import device as world_device

# The scenario's prepare (warm imports in the parent before any world forks).
from ....testing.dist_optimizer import prepare  # noqa: F401
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 2
TARGET_SEED = 98765
# The model's parameters, in the order the optimizer's one group gets them: an fp32 one between
# two bf16 ones, so that the release's numbering (bf16 parameters only) pairs the fp32 parameter's
# state (id 1) with the last bf16 parameter and has no parameter for the last id.
PARAMS = (("first", torch.bfloat16, (16, 8)), ("kept_fp32", torch.float32, (8, 8)), ("last", torch.bfloat16, (4, 8)))
KINDS = ("main", "exp_avg", "exp_avg_sq")


def build(seed):
    """The model under Megatron's DDP and its optimizer, parameters drawn from ``seed``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
    )
    module = MegatronModule(config)
    for name, dtype, shape in PARAMS:
        module.register_parameter(name, torch.nn.Parameter(values(seed, "param", name, shape=shape).to(dtype)))
    module = module.to(world_device())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), module)
    return model, get_megatron_optimizer(optimizer_config(use_distributed_optimizer=False), [model])


def float16_optimizers(opt):
    """The Float16OptimizerWithFloat16Params behind what get_megatron_optimizer returned."""
    return getattr(opt, "chained_optimizers", None) or [opt]


def state(model, opt) -> dict:
    """Each parameter, its fp32 main value and Adam moments, paired as training pairs them (the
    optimizer's own groups: a bf16 parameter's copy, the fp32 parameter itself)."""
    out = {}
    for inner in float16_optimizers(opt):
        mains = {}
        for models, copies in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            mains.update({id(p): c for p, c in zip(models, copies)})
        for group in inner.fp32_from_fp32_groups:
            mains.update({id(p): p for p in group})
        for name, p in model.module.named_parameters():
            main = mains[id(p)]
            out[f"param/{name}"] = p.detach().float().clone()
            out[f"main/{name}"] = main.detach().clone()
            for kind in KINDS[1:]:
                out[f"{kind}/{name}"] = inner.optimizer.state[main][kind].detach().clone()
    return out


def request(model, opt, is_loading):
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import dist_checkpointing

    rt = RoundTrip()
    save_dir = os.path.join(ckpt_dir, "float16_optimizer")
    with rt.running(), world(device), optimizer_path(apex=True):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt["device"] = str(world_device())
        rt.phase("save")
        source, source_opt = build(SOURCE_SEED)
        for i in range(STEPS):
            step(source, source_opt, i)
        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(request(source, source_opt, is_loading=False), save_dir)
        saved = state(source, source_opt)
        rt.phase("load")
        target, target_opt = build(TARGET_SEED)
        step(target, target_opt, 0)
        loaded = dist_checkpointing.load(request(target, target_opt, is_loading=True), save_dir)
        target.module.load_state_dict(loaded["model"])
        target_opt.load_state_dict(loaded["optimizer"])
        rt.phase("compare")
        rt.compare(saved, state(target, target_opt))
        step(source, source_opt, STEPS)
        step(target, target_opt, STEPS)
        rt.compare(state(source, source_opt), state(target, target_opt), prefix="next/")
    return rt.result
