"""hybrid-optimizer-fp32-params' round trips: Megatron's ``HybridDeviceOptimizer`` with every
parameter's optimizer state offloaded to the CPU (``optimizer_cpu_offload``, offload fraction 1.0,
Megatron-LM's default), its ``state_dict()`` saved as Megatron-LM's ``torch`` format saves an
optimizer (one file per rank) and loaded with ``load_state_dict``, on 2 gloo ranks.

A one-layer GPT (local spec) under Megatron's DDP (no distributed optimizer: with it, an fp32
parameter already stops the optimizer's construction, see doc.md), ``STEPS`` optimizer steps on
deterministic gradients, saved; then one more step, the reference. A target run (other initial
values, one step taken) loads the model and then the optimizer, as ``load_checkpoint`` does, and
takes the same next step. Three models (``CASES``):

* ``fp32``: an fp32 model, its optimizer from ``get_megatron_optimizer`` (an ``FP32Optimizer``
  around the hybrid optimizer): every parameter fp32, none has an fp32 copy;
* ``mixed``: a bf16 model whose norms and position embedding are fp32 (torch's ``LayerNorm``, no
  ``Float16Module``), with the hybrid optimizer built directly with ``get_megatron_optimizer``'s
  arguments, as a framework that handles mixed precision itself holds it;
* ``bf16``: every parameter bf16 (``Float16Module``), the hybrid optimizer built the same way: each
  parameter has an fp32 copy, the path the release loads; it must load exactly with the fix as
  without it.

Checked on every rank: the load completes; the model parameters, each parameter's optimizer state
(``exp_avg``, ``exp_avg_sq``, ``master_param``, ``step``) and the tensor its sub-optimizer updates
(``inner/``: the fp32 copy, or the CPU copy of an fp32 parameter) equal what was saved
(``max_delta``), and after one more step the uninterrupted run's (``next/...``).

What is not real on a CPU host: no tensor is on a GPU. The model's parameters report ``is_cuda``
(:func:`on_device`), so the hybrid optimizer splits them as on a GPU host: each gets a CPU copy
(``pin_memory`` a no-op) that CPU optimizers (torch's ``AdamW``) update and copy back; CUDA streams
and events are stand-ins that order nothing (CPU work is ordered already). An offload fraction
below 1 (fp32 copies and an optimizer that stay on the GPU) is not run here. The gradients are
drawn, as :mod:`mcore_ckpt_fixes.testing.dist_optimizer` says.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import placement
from ....testing.dist_optimizer import SOURCE_SEED, distributed, values, world
from ....testing.offload import on_device
from ....testing.result import RoundTrip, error_line
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 2
TARGET_SEED = 4321
# case -> (parameter dtype, wrapped in Float16Module, optimizer from get_megatron_optimizer)
CASES = {
    "fp32": (torch.float32, False, True),
    "mixed": (torch.bfloat16, False, False),
    "bf16": (torch.bfloat16, True, False),
}


def prepare() -> None:
    """Warm imports in the parent before any world forks."""
    import megatron.core.optimizer  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401


def build_model(seed, case, device):
    """A one-layer GPT under Megatron's DDP (no distributed optimizer), parameters drawn from ``seed``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    dtype, float16_module = CASES[case][:2]
    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        use_cpu_initialization=True,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(values(seed, "param", name, shape=p.shape))
    gpt.to(placement.device())  # the rank's GPU in a cuda world (on_device then stands in for nothing)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(), Float16Module(config, gpt) if float16_module else gpt
    )
    if device is not None:
        device.register(model.module.parameters())
    return model


def _optimizer_config(dtype):
    from megatron.core.optimizer import OptimizerConfig

    bf16 = dtype == torch.bfloat16
    return OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        bf16=bf16,
        params_dtype=dtype,
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,  # Megatron-LM's default: every parameter's state on the CPU
    )


def build(seed, case, device):
    """``(model, optimizer, its HybridDeviceOptimizers)`` for ``case``."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    model = build_model(seed, case, device)
    dtype, _, through_megatron = CASES[case]
    config = _optimizer_config(dtype)
    if through_megatron:
        opt = get_megatron_optimizer(config, [model])
        return model, opt, [d.optimizer for d in distributed(opt)]
    # The hybrid optimizer as get_megatron_optimizer builds it (its Adam branch), over the model's
    # parameters, as a framework that manages mixed precision itself holds it.
    opt = HybridDeviceOptimizer(
        list(model.module.parameters()),
        offload_fraction=config.optimizer_offload_fraction,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
        pin_cpu_grads=config.pin_cpu_grads,
        pin_cpu_params=config.pin_cpu_params,
        param_update_in_fp32=True,
        lr=config.lr,
        weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )
    return model, opt, [opt]


def step(model, opt, index):
    """One optimizer step on gradients drawn for step ``index`` (the reduced gradient every rank holds)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    for name, p in model.module.named_parameters():
        grad = values(SOURCE_SEED, "grad", index, name, shape=p.shape)
        p.main_grad.copy_(grad)
        p.grad = grad.to(device=p.device, dtype=p.dtype)  # what the hybrid optimizer reads when it is not wrapped
    result = opt.step()
    assert result is None or result[0], "the optimizer skipped a step"


def local_state(model, hybrid):
    """The model parameters and, per parameter, its hybrid optimizer state and the tensor its
    sub-optimizer updates (``inner/``: the fp32 copy, or the CPU copy of an fp32 parameter)."""
    out = {}
    for name, p in model.module.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        for hdo in hybrid:
            if p not in hdo.param_to_inner_param:
                continue
            out[f"inner/{name}"] = hdo.param_to_inner_param[p].detach().clone()
            for k, v in hdo.state[p].items():
                out[f"{k}/{name}"] = torch.as_tensor(v).detach().clone()
    return out


def fp32_params(model):
    return sorted(n for n, p in model.module.named_parameters() if p.dtype == torch.float32)


def key_error_line(exc) -> str:
    """A ``KeyError`` whose key is a tensor (a parameter: its repr is its values) as the key's dtype."""
    if isinstance(exc, KeyError) and exc.args and isinstance(exc.args[0], torch.Tensor):
        return f"KeyError: a {exc.args[0].dtype} tensor"
    return error_line(exc)


def run_case(name, ckpt_dir, patched, device):
    rt = RoundTrip(key_error_line, case=name, steps=STEPS)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        model, opt, hybrid = build(SOURCE_SEED, name, device)
        rt["fp32_params"] = fp32_params(model)
        for i in range(STEPS):
            step(model, opt, i)
        rt.phase("save")
        # Megatron-LM's torch format: each rank writes its optimizer's state_dict().
        path = os.path.join(ckpt_dir, f"{name}-rank{dist.get_rank()}.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        saved = local_state(model, hybrid)
        step(model, opt, STEPS)
        reference = local_state(model, hybrid)
        model, opt, hybrid = build(TARGET_SEED, name, device)
        step(model, opt, 100)
        rt.phase("load")
        loaded = torch.load(path, weights_only=False)
        model.load_state_dict(loaded["model"])  # the model first, as load_checkpoint does
        opt.load_state_dict(loaded["optimizer"])
        rt.compare(saved, local_state(model, hybrid))
        step(model, opt, STEPS)
        rt.compare(reference, local_state(model, hybrid), prefix="next/")
    return rt.result


def _world_cases(names, ckpt_dir, patched, device="cpu"):
    out = {}
    with world(device), on_device() as mode:
        for name in names:
            out[name] = placement.placed(run_case(name, ckpt_dir, patched, mode))
    return out


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (``names``, default every case): ``{case: result}``."""
    return _world_cases(names or CASES, ckpt_dir, patched, device)


def fp32(rank, world_size, ckpt_dir, patched, device="cpu"):
    """The selftest scenario: the fp32 model alone."""
    return _world_cases(("fp32",), ckpt_dir, patched, device)["fp32"]
