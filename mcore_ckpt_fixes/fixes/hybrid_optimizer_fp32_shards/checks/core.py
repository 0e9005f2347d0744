"""hybrid-optimizer-fp32-shards' round trips: Megatron's DDP and distributed optimizer with the hybrid
optimizer (``optimizer_cpu_offload``, offload fraction 1.0 and ``use_precision_aware_optimizer``, as
Megatron-LM requires), on 2 gloo ranks (DP=2: each rank owns half of every buffer).

Two models (``CASES``), each a one-layer GPT (local spec) under ``DistributedDataParallel``:

* ``fp32``: an fp32 model (no ``Float16Module``): every shard the optimizer gets is fp32;
* ``mixed``: a bf16 model whose norms and position embedding stay fp32 (torch's ``LayerNorm``, no
  ``Float16Module``): fp32 shards beside bf16 ones.

Each case, in one world: the optimizer is built from ``get_megatron_optimizer`` (phase ``build``,
where the release raises); ``STEPS`` steps on deterministic gradients, each followed by the same
update computed apart (phase ``train``): per locally owned parameter slice, torch's fused ``AdamW``
(the hybrid optimizer's CPU optimizer) with its parameter group's lr, weight decay, betas and eps,
on the gradient the model held, scaled as Megatron clips it (``clip_grad`` 1.0 over the grad norm the
step returns); the value the optimizer updates (``train/inner/``) and the model parameter's slice
(``train/model/``) must equal it, so the gradient reached each shard and the update reached the model.
``fp32_shards`` records, per fp32 parameter of this rank, whether its shard is a leaf that shares the
parameter's storage.

``fp32`` also round-trips through ``dist_checkpointing`` in ``dp_reshardable`` (Megatron-LM's default)
and ``fully_reshardable``: the source run is saved after ``STEPS`` steps, takes one more (the
reference); a target run (other initial values, its optimizer fresh: no step taken before the load)
loads the model and then the optimizer, as ``load_checkpoint`` does, and takes the same next step.
Compared on every rank: the model parameters, each parameter's hybrid optimizer state (``exp_avg``,
``exp_avg_sq``, ``master_param``, ``step``) and the tensor its sub-optimizer updates (``inner/``)
against what was saved, and after the next step against the uninterrupted run's (``next/``). The
load also needs hybrid-optimizer-fp32-params (on by default). A fresh optimizer does not keep
``dp_reshardable`` clear of hybrid-device-optimizer-stale-step: the load request itself initialises
the hybrid optimizer's state (a step of its own), and the load keeps that step; ``step_fix`` records
whether its fix runs here (the test expects the step alone to differ where it does not).

What is not real on a CPU host: no tensor is on a GPU, as
:mod:`mcore_ckpt_fixes.testing.offload` says (parameters that report ``is_cuda``, stream
stand-ins), and Megatron's CUDA allocations are made on the CPU
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`). Megatron's optimizer modules see Apex's FusedAdam
(:func:`mcore_ckpt_fixes.testing._fused_adam.optimizer_path`), so the distributed optimizer takes the
branches a GPU host takes for the hybrid optimizer; with offload fraction 1.0 every parameter is
updated by torch's ``AdamW`` on the CPU, as there. Before 0.17 ``OptimizerConfig`` asks for
Transformer Engine's version for the precision-aware optimizer, which raises without it: the check
gets the answer 0.17 on gives without Transformer Engine (:func:`mcore_ckpt_fixes.testing.offload.precision_aware_without_te`). Before 0.19 the load
of the checkpoint's common state refuses the optimizer classes the hybrid optimizer keeps in its
parameter groups (torch's ``weights_only`` default): hybrid-optimizer-common-state, on by default,
allows them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import placement
from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import SOURCE_SEED, distributed, optimizer_config, request, values, world
from ....testing.offload import on_device, precision_aware_without_te
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from ...torch_adam_step.checks.core import dp_reshardable_keeps_step
from .. import ID, MODULE

STEPS = 2
TARGET_SEED = 4321
CLIP_GRAD = 1.0  # OptimizerConfig's default
CASES = {"fp32": torch.float32, "mixed": torch.bfloat16}  # case -> the model's dtype
FORMATS = ("dp_reshardable", "fully_reshardable")
# The mixed model is not saved: with fp32 parameters beside bf16 ones in a parameter group the
# release's distributed optimizer pairs parameters with the wrong shards when it checkpoints
# (dist-optimizer-mixed-dtype-group-order, with or without cpu offload).
ROUND_TRIPS = {"fp32": FORMATS, "mixed": ()}
# The fix of hybrid-device-optimizer-stale-step: without it a dp_reshardable load leaves each
# parameter's step at the one the load request's initialisation took (recorded, see the test).
STEP_FIX = "torch-adam-step"


def prepare() -> None:
    """Warm imports in the parent before any world forks."""
    from ....testing.dist_optimizer import prepare as warm

    warm()


def build(seed, case, device):
    """``(model, optimizer)``: the case's GPT under DDP and ``get_megatron_optimizer``'s hybrid optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    dtype = CASES[case]
    bf16 = dtype == torch.bfloat16
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=2, use_cpu_initialization=True, bf16=bf16, params_dtype=dtype
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(values(seed, "param", name, shape=p.shape))
    gpt.to(placement.device())  # the rank's GPU in a cuda world (on_device then stands in for nothing)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt)
    if device is not None:
        device.register(model.module.parameters())
    opt_config = optimizer_config(
        bf16,
        clip_grad=CLIP_GRAD,
        use_precision_aware_optimizer=True,  # Megatron-LM requires it with --optimizer-cpu-offload
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=1.0,  # Megatron-LM's default: every parameter's state on the CPU
    )
    return model, get_megatron_optimizer(opt_config, [model])


def owned(model, opt):
    """``{name: (model parameter, its shard in the hybrid optimizer, the hybrid optimizer, range)}``
    for the parameters this rank owns a slice of, paired as the distributed optimizer pairs them to
    hand over gradients (its model and shard groups)."""
    shards = {}
    for d in distributed(opt):
        pairs = ((d.model_float16_groups, d.shard_float16_groups), (d.model_fp32_groups, d.shard_fp32_groups))
        for model_groups, shard_groups in pairs:
            for params, group_shards in zip(model_groups, shard_groups):
                for p, shard in zip(params, group_shards):
                    shards[p] = (p, shard, d.optimizer, d._get_model_param_range_map(p)["param"])
    return {name: shards[p] for name, p in model.module.named_parameters() if p in shards}


def fp32_shards(model, opt) -> dict:
    """Per fp32 parameter of this rank: (its shard is a leaf, it shares the parameter's storage)."""
    return {
        name: (shard.is_leaf, shard.untyped_storage().data_ptr() == p.untyped_storage().data_ptr())
        for name, (p, shard, _, _) in owned(model, opt).items()
        if p.dtype == torch.float32
    }


def step(model, opt, index):
    """One optimizer step on gradients drawn for step ``index`` (the reduced gradient every rank
    holds); returns ``(the gradients the model held, the grad norm)``."""
    model.zero_grad_buffer()
    opt.zero_grad()
    grads = {}
    for name, p in model.module.named_parameters():
        p.main_grad.copy_(values(SOURCE_SEED, "grad", index, name, shape=p.shape))
        grads[name] = p.main_grad.detach().clone()
    ok, grad_norm, _ = opt.step()
    assert ok, "the optimizer skipped a step"
    return grads, grad_norm


class Reference:
    """The same update computed apart from Megatron: torch's fused ``AdamW`` per owned parameter
    slice, from its initial value, with its parameter group's settings."""

    def __init__(self, model, opt):
        self.slices, self.optimizers = {}, {}
        # The group index only: the position within a group is off where fp32 and bf16 parameters
        # share it (dist-optimizer-mixed-dtype-group-order).
        groups = {
            n: d.model_param_group_index_map[p][0]
            for n, p in model.module.named_parameters()
            for d in distributed(opt)
            if p in d.model_param_group_index_map
        }
        for name, (p, shard, hdo, rng) in owned(model, opt).items():
            group = hdo.param_groups[groups[name]]
            value = p.detach().view(-1)[rng.start : rng.end].float().clone()
            self.slices[name] = (rng, value)
            self.optimizers[name] = torch.optim.AdamW(
                [value], lr=group["lr"], weight_decay=group["weight_decay"], betas=group["betas"],
                eps=group["eps"], fused=True,
            )  # fmt: skip

    def step(self, grads, grad_norm):
        coeff = CLIP_GRAD / (grad_norm + 1.0e-6)  # Megatron's clip coefficient (clip_grads.py)
        for name, (rng, value) in self.slices.items():
            grad = grads[name].view(-1)[rng.start : rng.end]
            value.grad = (grad * coeff if coeff < 1.0 else grad).float()  # scaled in the gradient's dtype
            self.optimizers[name].step()

    def expected(self, model, opt):
        """``(expected, got)`` for ``train/inner/`` and ``train/model/``."""
        expected, got = {}, {}
        for name, (p, shard, hdo, rng) in owned(model, opt).items():
            value = self.slices[name][1]
            expected[f"inner/{name}"], got[f"inner/{name}"] = (
                value.detach().clone(),
                hdo.param_to_inner_param[shard].detach().view(-1).clone(),
            )
            expected[f"model/{name}"] = value.detach().to(p.dtype)
            got[f"model/{name}"] = p.detach().view(-1)[rng.start : rng.end].clone()
        return expected, got


def local_state(model, opt):
    """The model parameters and, per owned parameter, the hybrid optimizer's state and the tensor its
    sub-optimizer updates (``inner/``)."""
    out = {f"model/{name}": p.detach().clone() for name, p in model.module.named_parameters()}
    for name, (_, shard, hdo, _) in owned(model, opt).items():
        out[f"inner/{name}"] = hdo.param_to_inner_param[shard].detach().clone()
        for k, v in hdo.state[shard].items():
            out[f"{k}/{name}"] = torch.as_tensor(v).detach().clone()
    return out


def train_and_save(rt, case, formats, ckpt_dir, device):
    """The source run: build, ``STEPS`` steps checked against :class:`Reference`, saved in each of
    ``formats``; returns ``(paths, saved state, the state after one more step)``."""
    from megatron.core import dist_checkpointing

    rt.phase("build")
    model, opt = build(SOURCE_SEED, case, device)
    rt["fp32_shards"] = fp32_shards(model, opt)
    reference = Reference(model, opt)
    rt.phase("train")
    for i in range(STEPS):
        reference.step(*step(model, opt, i))
    rt.compare(*reference.expected(model, opt), prefix="train/")
    paths = {}
    if not formats:
        return paths, None, None
    for fmt in formats:
        rt.phase("save")
        paths[fmt] = os.path.join(ckpt_dir, f"{case}-{fmt}")
        if dist.get_rank() == 0:
            os.makedirs(paths[fmt], exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(request(model, opt, fmt, False), paths[fmt])
    saved = local_state(model, opt)
    step(model, opt, STEPS)
    return paths, saved, local_state(model, opt)


def load_and_step(rt, case, fmt, path, saved, after, device):
    """A fresh target run loads ``path`` (the model, then the optimizer) and takes the next step."""
    from megatron.core import dist_checkpointing

    rt.phase("build")
    model, opt = build(TARGET_SEED, case, device)
    rt.phase("load")
    loaded = dist_checkpointing.load(request(model, opt, fmt, True), path)
    model.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    rt.compare(saved, local_state(model, opt), prefix=f"{fmt}/")
    rt.phase("next step")
    step(model, opt, STEPS)
    rt.compare(after, local_state(model, opt), prefix=f"{fmt}/next/")


def fix_state(fix_id):
    """Another fix's state in this process (None where there is no such fix)."""
    import mcore_ckpt_fixes

    return next((r["state"] for r in mcore_ckpt_fixes.report() if r["id"] == fix_id), None)


def saves_per_parameter_step() -> bool:
    """Does this release's dp_reshardable keep a per-parameter step out of its bucket tensors?"""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    has = hasattr(DistributedOptimizer, "sharded_param_state_dp_reshardable")
    return has and dp_reshardable_keeps_step() is None


def run_case(case, ckpt_dir, patched, device, round_trips=True):
    # Before 0.16 dp_reshardable cannot save the per-parameter step of torch's AdamW (the hybrid
    # optimizer's CPU optimizer): no round trip there, the build and the training still run.
    formats = ROUND_TRIPS[case] if round_trips and saves_per_parameter_step() else ()
    rt = RoundTrip(case=case, steps=STEPS, formats=list(formats))
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt["step_fix"] = fix_state(STEP_FIX)
        paths, saved, after = train_and_save(rt, case, formats, ckpt_dir, device)
        for fmt, path in paths.items():
            load_and_step(rt, case, fmt, path, saved, after, device)
    return rt.result


def _world_cases(names, ckpt_dir, patched, round_trips=True, device="cpu"):
    out = {}
    with world(device), precision_aware_without_te(), optimizer_path(apex=True), on_device() as mode:
        for name in names:
            out[name] = placement.placed(run_case(name, ckpt_dir, patched, mode, round_trips))
    return out


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (``names``, default every case): ``{case: result}``."""
    return _world_cases(names or CASES, ckpt_dir, patched, device=device)


def fp32(rank, world_size, ckpt_dir, patched, device="cpu"):
    """The selftest scenario: the fp32 model built and trained, not saved. Its checkpoint round trips
    also need hybrid-optimizer-fp32-params (the load) and, for dp_reshardable, the stale-step fix:
    the fix test runs them with every fix at its default."""
    return _world_cases(("fp32",), ckpt_dir, patched, round_trips=False, device=device)["fp32"]
