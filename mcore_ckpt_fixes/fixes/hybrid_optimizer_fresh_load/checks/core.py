"""hybrid-optimizer-fresh-load's round trips on 2 gloo ranks (DP=2): a load of the model's weights
without the optimizer's state under ``optimizer_cpu_offload`` (offload fraction 1.0, the default).

Core API (``CASES``, one world): a one-layer GPT under Megatron's DDP and ``get_megatron_optimizer``
with the distributed optimizer and the hybrid optimizer. A source run trains two steps; a target
run (other initial weights) is built, its model loads the source's weights (``load_state_dict``)
and ``reload_model_params()`` refreshes the optimizer, as ``load_checkpoint`` does without the
optimizer's state (phase ``reload``); it takes one step, and so does a reference built over the
loaded weights. Compared on every rank: what the hybrid optimizer steps (its parameter, the main
shard without the precision-aware optimizer, and the copy its CPU optimizer updates) against the
loaded model before the step (``copies_vs_loaded``; ``copies_vs_initial``: the copy the CPU
optimizer updates against the target's initial weights), and after it the model, main shards, Adam moments and ``inner/`` copies against
the reference (``max_delta``). Cases: ``bf16`` (Float16Module, no precision-aware optimizer, as
Megatron-Bridge and NeMo-RL may build it), ``precision_aware`` (bf16 as Megatron-LM requires it:
where the release works, ``digests`` of the state after the step let the test hold the two halves
bit-identical), ``fp32`` (an fp32 model; it builds only with hybrid-optimizer-fp32-shards).
Any stale copy or difference ends the case in phase ``compare`` with :data:`scenarios.STALE`.

``training`` (megatron.training, 0.17 on): the small GPT of :mod:`mcore_ckpt_fixes.testing.gpt_job`
in fp32 with ``--optimizer-cpu-offload --use-precision-aware-optimizer``, trained two steps and saved
with ``save_checkpoint``, then built anew and loaded with ``load_checkpoint`` once per way of
``WAYS`` (``--no-load-optim``, ``--finetune``), one step against a reference built over the loaded
weights, compared as above (keys ``<way>/...``).

What is not real on a CPU host: no tensor is on a GPU (:mod:`mcore_ckpt_fixes.testing.offload`:
parameters report ``is_cuda``; while the optimizer is built, the main shards made from them too, and
their CPU clones do not), Megatron's CUDA allocations are made on the CPU, and its optimizer modules
see Apex's FusedAdam, so they take a GPU host's branches; before 0.17 the precision-aware optimizer is
accepted without Transformer Engine (``precision_aware_without_te``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist

from ....testing.dist_optimizer import build_model, distributed, one_case, optimizer_config, run_cases, step
from ....testing.offload import offload_path, offloaded_state
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE, TRAINING
from .scenarios import STALE

CASES = {"bf16": (True, False), "precision_aware": (True, True), "fp32": (False, True)}  # (bf16, precision-aware)
SOURCE_SEED, TARGET_SEED = 1, 2
WAYS = ("--no-load-optim", "--finetune")
OFFLOAD = ("--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--lr-warmup-iters", "0")


def prepare() -> None:
    """Warm imports in the parent before any world forks."""
    from ....testing.dist_optimizer import prepare as warm
    from ....testing.gpt_job import training_checkpointing

    warm()
    training_checkpointing()


def _deriving(device):
    return device.deriving() if device is not None else contextlib.nullcontext()


def _build(case, seed, device, weights=None):
    bf16, precision_aware = CASES[case]
    model = build_model(seed, bf16=bf16)
    if device is not None:
        device.register(model.module.parameters())
    if weights is not None:
        model.load_state_dict(weights)
    from megatron.core.optimizer import get_megatron_optimizer

    config = optimizer_config(
        bf16, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=precision_aware
    )
    with _deriving(device):  # the main shards made from the model's are on its device, as there
        return model, get_megatron_optimizer(config, [model])


def copies_vs(model, opt, reference, inner_only=False):
    """The largest difference between what the hybrid optimizer steps (each parameter and the copy a
    sub-optimizer updates, or ``inner_only`` that copy) and this rank's shard of ``reference``
    (``{name: tensor}``)."""
    worst = 0.0
    for name, p in model.module.named_parameters():
        for d in distributed(opt):
            if p not in d.model_param_group_index_map:
                continue
            gi, go = d.model_param_group_index_map[p]
            param = d.optimizer.param_groups[gi]["params"][go]
            span = d._get_model_param_range_map(p)["param"]
            want = reference[name].detach().float().view(-1)[span.start : span.end]
            inner = d.optimizer.param_to_inner_param.get(param, param)
            for got in (inner,) if inner_only else (param, inner):
                worst = max(worst, float((got.detach().float().cpu() - want.cpu()).abs().max()))
    return worst


def params(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def digest(tensor) -> str:
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def judge(rt, prefix="") -> None:
    """End the case with :data:`STALE` where a copy was stale or the step differs from the reference."""
    rt.phase("compare")
    stale = rt[f"{prefix}copies_vs_loaded"] != 0.0 or any(rt["max_delta"].values())
    if stale:
        raise AssertionError(STALE.error.partition(": ")[2])


def run_case(case, ckpt_dir, patched, cache=None):
    rt = RoundTrip(copies_vs_loaded=None, copies_vs_initial=None, cpu_copies=None)
    with rt.running(), offload_path(apex=True) as device:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("build")
        source, source_opt = _build(case, SOURCE_SEED, device)
        for i in range(2):
            step(source, source_opt, i)
        weights = {k: (v.clone() if v is not None else None) for k, v in source.state_dict().items()}
        model, opt = _build(case, TARGET_SEED, device)
        initial = params(model)
        # Parameters the sub-optimizers step as CPU clones (all of them where the host has a GPU).
        rt["cpu_copies"] = sum(len(d.optimizer.gpu_params_map_cpu_copy) for d in distributed(opt))
        rt.phase("reload")
        model.load_state_dict(weights)
        opt.reload_model_params()
        rt["copies_vs_loaded"] = copies_vs(model, opt, params(model))
        rt["copies_vs_initial"] = copies_vs(model, opt, initial, inner_only=True)
        rt.phase("step")
        step(model, opt, 5)
        reference, reference_opt = _build(case, TARGET_SEED, device, weights)
        step(reference, reference_opt, 5)
        got, want = offloaded_state(model, opt), offloaded_state(reference, reference_opt)
        rt["max_delta"] = {k: float((got[k].float() - want[k].float()).abs().max()) for k in sorted(want)}
        rt["n_tensors"] = len(want)
        rt["digests"] = {k: digest(v) for k, v in got.items()}
        judge(rt)
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Every core-API case in one world: ``{case: result}``."""
    return run_cases(run_case, names or tuple(CASES), ckpt_dir, patched, device)


bf16 = one_case(run_case, "bf16")
precision_aware = one_case(run_case, "precision_aware")
fp32 = one_case(run_case, "fp32")


# -- megatron.training: an fp32 job saved, then loaded without the optimizer's state -------------------


def _job(args, cfg, mode, weights=None):
    from ....testing import gpt_job as job

    def on_model(model):
        if mode is not None:
            mode.register(model.module.parameters())
        if weights is not None:
            model.load_state_dict(weights)

    return job.build(args, cfg, on_model)


def _one_way(rt, way, cfg, ckpt_dir, mode):
    from megatron.training import global_vars
    from megatron.training.checkpointing import load_checkpoint

    from ....testing import gpt_job as job

    global_vars.unset_global_variables()
    args = job.parse_args(cfg, ckpt_dir, 10, (way,))
    model, opt, sched = _job(args, cfg, mode)
    initial = params(model)
    load_checkpoint([model], opt, sched)
    rt[f"{way}/copies_vs_loaded"] = copies_vs(model, opt, params(model))
    rt[f"{way}/copies_vs_initial"] = copies_vs(model, opt, initial, inner_only=True)
    weights = {k: (v.clone() if v is not None else None) for k, v in model.state_dict().items()}
    reference, reference_opt, reference_sched = _job(args, cfg, mode, weights)
    for m, o, s in ((model, opt, sched), (reference, reference_opt, reference_sched)):
        job.seed(args)
        job.train_step(m, o, s, args, torch.Generator().manual_seed(7))
    got, want = params(model), params(reference)
    for k in sorted(want):
        rt["max_delta"][f"{way}/model/{k}"] = float((got[k].float() - want[k].float()).abs().max())


def training(rank, world_size, ckpt_dir, patched, device="cpu"):
    from ....testing import gpt_job as job
    from ....testing.job_config import Config
    from ....testing.offload import on_device

    rt = RoundTrip(**{f"{way}/{k}": None for way in WAYS for k in ("copies_vs_loaded", "copies_vs_initial")})
    cfg = Config("offload-fp32", "fp32 GPT, DP=2, --optimizer-cpu-offload", world=2, bf16=False, extra_args=OFFLOAD)
    directory = os.path.join(ckpt_dir, "training")
    with rt.running(), job.worker(cfg, device) as cpu_gen, on_device() as mode:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (TRAINING,), patched)
        rt.phase("save")
        from megatron.core import parallel_state as mpu
        from megatron.training.checkpointing import save_checkpoint

        args = job.parse_args(cfg, directory, 10)
        mpu.initialize_model_parallel()
        job.seed(args)
        model, opt, sched = _job(args, cfg, mode)
        rt["device"] = str(next(model.parameters()).device)  # the rank's GPU where there is one
        for _ in range(2):
            job.train_step(model, opt, sched, args, cpu_gen)
        save_checkpoint(2, [model], opt, sched, 0)
        dist.barrier()
        for way in WAYS:
            rt.phase(f"load {way}")
            _one_way(rt, way, cfg, directory, mode)
        rt["n_tensors"] = len(rt["max_delta"])
        rt.phase("compare")
        if any(rt[f"{way}/copies_vs_loaded"] != 0.0 for way in WAYS) or any(rt["max_delta"].values()):
            raise AssertionError(STALE.error.partition(": ")[2])
    return rt.result
