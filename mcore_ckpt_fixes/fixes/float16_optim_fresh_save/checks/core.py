"""float16-optim-fresh-save's round trips: Megatron's DDP and the non-distributed mixed-precision
optimizer (``get_megatron_optimizer`` with fp16 and without the distributed optimizer:
``Float16OptimizerWithFloat16Params`` with its dynamic loss scaler) over a two-parameter fp16 module,
on 2 gloo ranks (DP=2), one world per half, both cases in it.

Each case: a source run whose first step overflows (an infinite gradient, as an fp16 run's first
steps give under a high initial loss scale), so that the loss scaler skips it and Adam never steps,
saves its model and optimizer with ``dist_checkpointing`` (the request ``megatron.training`` builds,
``is_loading=False``); a target run with other values loads them (``is_loading=True``, as
``load_checkpoint`` asks). Compared: every parameter and fp32 main value, the loss scale, whether the
optimizer holds state (the source holds none), then after one real step on both runs every value
and Adam moment again (``next/``). Cases: Adam on the path Megatron takes with Apex installed
(:mod:`mcore_ckpt_fixes.testing._fused_adam`'s CPU stand-in: the step count lives in the param
groups) and on torch's Adam (no Apex or Transformer Engine: a step count per parameter); and, where the
release works, a source whose first step is taken (torch's Adam): both halves exact.

What is not real: the gradients (drawn, the same on every rank; the overflow an infinite value),
Apex's FusedAdam (a stand-in in plain torch ops) and, on a CPU host, the CUDA tensors
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import SOURCE_SEED, one_case, optimizer_config, run_cases, values

# The scenario's prepare (warm imports in the parent before any world forks).
from ....testing.dist_optimizer import prepare  # noqa: F401
from ....testing.result import RoundTrip, error_line
from ...float16_optim_fp32_params.checks.core import request  # the same model + optimizer request
from ....testing.states import fix_states
from .. import ID, MODULE

TARGET_SEED = 98765
PARAMS = (("weight", (16, 8)), ("bias", (16,)))
# The two cases the fix is for, and one where the release works (the source steps before it saves):
# both halves the same, exact.
CASES = ("fused_adam", "torch_adam", "stepped_torch_adam")


def build(seed):
    """The module under Megatron's DDP and its fp16 optimizer (dynamic loss scale from 2**32, as
    Megatron-LM's default), parameters drawn from ``seed``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    from ....testing.dist_optimizer import device

    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, fp16=True, params_dtype=torch.float16
    )
    module = MegatronModule(config)
    for name, shape in PARAMS:
        module.register_parameter(name, torch.nn.Parameter(values(seed, "param", name, shape=shape).half()))
    module = module.to(device())
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), module)
    opt_config = optimizer_config(
        bf16=False, fp16=True, params_dtype=torch.float16, use_distributed_optimizer=False, initial_loss_scale=2.0**32
    )
    return model, get_megatron_optimizer(opt_config, [model])


def step(model, opt, index, overflow=False):
    """One step on gradients drawn for step ``index``; ``overflow``: one gradient is infinite, and the
    loss scaler skips the step. Returns whether the optimizer stepped."""
    model.zero_grad_buffer()
    opt.zero_grad()
    for name, p in model.module.named_parameters():
        p.main_grad.copy_(values(SOURCE_SEED, "grad", index, name, shape=p.shape))
        if overflow and name == PARAMS[0][0]:
            p.main_grad.view(-1)[0] = float("inf")
    ok, _, _ = opt.step()
    return ok


def float16_optimizer(opt):
    """The Float16OptimizerWithFloat16Params behind what get_megatron_optimizer returned."""
    chained = getattr(opt, "chained_optimizers", None)
    return chained[0] if chained else opt


def state(model, opt) -> dict:
    """Each parameter, its fp32 main value and, where the optimizer holds them, its Adam moments; the
    loss scale."""
    inner = float16_optimizer(opt)
    mains = {id(p): c for ps, cs in zip(inner.float16_groups, inner.fp32_from_float16_groups) for p, c in zip(ps, cs)}
    out = {"loss_scale": inner.get_loss_scale().detach().float().clone().view(1)}
    for name, p in model.module.named_parameters():
        main = mains[id(p)]
        out[f"param/{name}"] = p.detach().float().clone()
        out[f"main/{name}"] = main.detach().clone()
        for kind, value in inner.optimizer.state.get(main, {}).items():
            if kind != "step":
                out[f"{kind}/{name}"] = value.detach().clone()
    return out


def holds_state(opt) -> bool:
    inner = float16_optimizer(opt)
    return any(inner.optimizer.state.get(p) for group in inner.optimizer.param_groups for p in group["params"])


def inner_error_line(exc) -> str:
    """torch DCP's CheckpointException wraps the failing rank's traceback: its last line, the error
    as that rank raised it (the whole text stays in raw_error)."""
    if type(exc).__name__ == "CheckpointException":
        lines = [line for line in str(exc).splitlines() if line.strip()]
        return lines[-1].strip() if lines else error_line(exc)
    return error_line(exc)


def run_case(case, ckpt_dir, patched, cache=None):
    """One case (inside a world of :mod:`mcore_ckpt_fixes.testing.dist_optimizer`): its result."""
    from megatron.core import dist_checkpointing

    rt = RoundTrip(inner_error_line)
    save_dir = os.path.join(ckpt_dir, case)
    with rt.running(), optimizer_path(apex=case == "fused_adam"):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        source, source_opt = build(SOURCE_SEED)
        rt["stepped"] = step(source, source_opt, 0, overflow=not case.startswith("stepped"))
        rt["source_holds_state"] = holds_state(source_opt)
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(request(source, source_opt, is_loading=False), save_dir)
        saved = state(source, source_opt)
        rt.phase("load")
        target, target_opt = build(TARGET_SEED)
        loaded = dist_checkpointing.load(request(target, target_opt, is_loading=True), save_dir)
        target.module.load_state_dict(loaded["model"])
        target_opt.load_state_dict(loaded["optimizer"])
        rt["target_holds_state"] = holds_state(target_opt)
        rt.compare(saved, state(target, target_opt))
        rt.phase("next step")
        rt["next_stepped"] = [step(source, source_opt, 1), step(target, target_opt, 1)]
        rt.compare(state(source, source_opt), state(target, target_opt), prefix="next/")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """The cases in one world: ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched, device)


fused_adam = one_case(run_case, "fused_adam")
torch_adam = one_case(run_case, "torch_adam")
