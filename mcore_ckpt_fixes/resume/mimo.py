"""One rank of a resume-check run of a non-colocated MIMO model trained through ``MimoOptimizer``.

The layout the mimo-optimizer fix is about: the language model on global rank 0, the vision
encoder on rank 1, each module on its own ranks with its own process groups, its own
``DistributedDataParallel`` and distributed optimizer (``dp_reshardable``), and on every rank one
``MimoOptimizer`` over both modules (its own active), as ``get_mimo_optimizer`` builds it. The
modules, their process groups and the ``MimoOptimizer`` are those of mimo-optimizer's round trips
(:mod:`mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core`: two TP linears per module; why
``get_mimo_optimizer`` itself is not called is said there). Here they are trained: every step
``MimoOptimizer.step`` (the global gradient norm across modules, clipping, each module's step) and
an ``OptimizerParamScheduler`` over it.

``megatron.training``'s ``save_checkpoint`` does not drive a MIMO model, so this saves as a MIMO user
does: one ``dist_checkpointing.save`` of the model's and the ``MimoOptimizer``'s sharded state dicts,
each rank's RNG state as a ``ShardedObject`` of its own, the scheduler and the iteration as common
state; the resumed run loads it with ``dist_checkpointing.load`` (through the round trips' save and
load, which share a rank's failure with the whole world instead of leaving the others waiting).

Randomness consumed every step, each into the loss: NumPy, Python's ``random`` and the CPU
generator make the sample (:func:`..testing.gpt_job.batch`), hidden dropout draws from the (stood-in) CUDA
generator, the dropout after the first linear from the tracker's model-parallel stream, and one draw
per tracker stream scales the loss (:func:`..testing.gpt_job.loss_scale`). The CPU stand-ins are the other
configurations' (:mod:`..testing.gpt_job`).
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

from ..testing import gpt_job as job
from ..testing.world_errors import WorldFailed

SEED = job.SEED
DROPOUT = 0.1
SHARDING_TYPE = "dp_reshardable"


def _mimo():
    """mimo-optimizer's round trips: the modules, the layout, the MimoOptimizer, save and load."""
    from ..fixes.mimo_optimizer.checks import core as round_trips

    return round_trips


class _Failed(Exception):
    """A collective step failed on some rank: every rank raises this, with the world's first error."""


def _seed(layout):
    """Per module, as Megatron seeds a pipeline stage (the modules are on different ranks)."""
    from megatron.core import tensor_parallel

    seed = SEED + 100 * _mimo().MODULES.index(layout.module)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=layout.tp_rank, ep_rank=0, etp_rank=0)


def _build(layout, steps):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    rt = _mimo()
    model = rt.module_model(layout, distributed=True)
    with torch.no_grad():  # the round trips' modules start at zero; a trained model does not
        for pname, p in model.module.named_parameters():
            p.copy_(0.3 * rt.seeded_values(SEED, layout.module, layout.tp_rank, "init", pname, shape=p.shape))
    config = OptimizerConfig(
        optimizer="adam",
        lr=0.01,
        min_lr=0.001,
        weight_decay=0.01,
        clip_grad=1.0,
        use_distributed_optimizer=True,
        bf16=True,
        fp16=False,
        params_dtype=torch.bfloat16,
    )
    opt = get_megatron_optimizer(config, [model], pg_collection=layout.pgs, use_gloo_process_groups=False)
    mimo = rt.mimo_optimizer(layout, opt, config)
    scheduler = OptimizerParamScheduler(mimo, 0.0, 0.01, 0.001, 1, steps, "cosine", 0.01, 0.01, steps, "constant")
    return rt.BuiltOptimizer(mimo, model, layout, opt), scheduler


def _forward(tower, tokens, labels):
    """The module: linear, GELU, dropout in the tracker's model-parallel stream, linear, dropout."""
    from megatron.core import tensor_parallel

    on = next(tower.parameters()).device  # the batch is drawn on the host, as in every run
    x = torch.nn.functional.one_hot(tokens.t() % tower.fc1.input_size, tower.fc1.input_size)
    h, _ = tower.fc1(x.to(device=on, dtype=torch.bfloat16))
    h = torch.nn.functional.gelu(h)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        h = torch.nn.functional.dropout(h, DROPOUT, training=True)
    out, _ = tower.fc2(h)
    out = torch.nn.functional.dropout(out, DROPOUT, training=True)
    target = torch.nn.functional.one_hot(labels.t() % out.shape[-1], out.shape[-1]).to(on).float()
    return ((out.float() - target) ** 2).mean()


def train_step(built, scheduler, cpu_gen):
    built.model.zero_grad_buffer()
    built.mimo.zero_grad()
    tokens, _, _, labels = job.batch(cpu_gen)
    loss = _forward(built.model.module, tokens, labels) * job.loss_scale()
    loss.backward()
    built.model.finish_grad_sync()
    ok, _, _ = built.mimo.step()
    assert ok, "MimoOptimizer skipped a step: the run would not be comparable"
    scheduler.step(increment=1)
    return float(loss.detach())


# -- the checkpoint ----------------------------------------------------------------------------------


def _rng_state():
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(),  # on a CPU host: the stand-in's generator
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state):
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


class _Checkpoint:
    """What a MIMO user checkpoints, in the place of the ``MimoOptimizer`` the round trips' save and
    load drive: ``sharded_state_dict`` gives the whole checkpoint and ``load_state_dict`` restores it."""

    def __init__(self, built, scheduler, iteration):
        self.built, self.scheduler, self.iteration = built, scheduler, iteration

    def sharded_state_dict(self, model_sd, is_loading=False, **kwargs):
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        rank, world = dist.get_rank(), dist.get_world_size()
        return {
            "model": model_sd,
            "optimizer": self.built.mimo.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs),
            # Each rank's streams are its own: one object per global rank (no rank stands for another).
            "rng_state": ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0),
            "opt_param_scheduler": self.scheduler.state_dict(),
            "iteration": self.iteration,
        }

    def load_state_dict(self, loaded):
        # DDP's sharded state dict names the wrapped module's entries "module.<name>"; its
        # load_state_dict hands the dict to the wrapped module, which knows them as "<name>".
        prefix = _mimo().MODEL_PREFIX[self.built.layout.module] + "module."
        assert all(k.startswith(prefix) for k in loaded["model"]), sorted(loaded["model"])
        self.built.model.load_state_dict({k[len(prefix) :]: v for k, v in loaded["model"].items()}, strict=True)
        self.built.mimo.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        _set_rng_state(loaded["rng_state"])
        self.iteration = loaded["iteration"]


def _checkpointed(built, scheduler, iteration):
    rt = _mimo()
    return rt.BuiltOptimizer(_Checkpoint(built, scheduler, iteration), built.model, built.layout, built.opt)


def _collective(fn, *args):
    """The round trips' save or load; a failure on any rank is raised on every rank (one line)."""
    try:
        return fn(*args)
    except WorldFailed as failed:
        per_rank = ", ".join(f"rank {r}" for r, e in enumerate(failed.rank_errors) if e)
        error = " ".join(failed.error.split())
        raise _Failed(f"{failed.phase} (raised on {per_rank}): {error}") from None


# -- one rank of one run --------------------------------------------------------------------------------


def snapshot(built, scheduler):
    """:func:`..testing.gpt_job.snapshot` of this rank's module, its own optimizer and the scheduler, plus the
    CUDA generator's stand-in on a CPU host (dropout draws from it)."""
    state = job.snapshot(built.model, built.opt, scheduler)
    state.setdefault("rng:cuda", torch.cuda.get_rng_state().clone())
    return state


def _run_phase(phase, ckpt_dir, steps, resume_at, cpu_gen):
    rt = _mimo()
    layout = rt.RankLayout()
    _seed(layout)
    built, scheduler = _build(layout, steps)
    coords = {"rank": dist.get_rank(), "module": layout.module, "tp": layout.tp_rank, "ep": 0, "dp": 0}
    out = {"coords": coords, "losses": {}}

    def train(first, last):
        return {step: train_step(built, scheduler, cpu_gen) for step in range(first, last + 1)}

    if phase == "uninterrupted":
        out["losses"] = train(1, steps)
    elif phase == "save":
        out["losses"] = train(1, resume_at)
        _collective(rt.save_built, _checkpointed(built, scheduler, resume_at), ckpt_dir, SHARDING_TYPE)
        out["losses"].update(train(resume_at + 1, steps))  # the run goes on after its save (job.py)
    else:
        ckpt = _checkpointed(built, scheduler, None)
        _, out["load_warnings"] = _collective(rt.load_built, ckpt, ckpt_dir, SHARDING_TYPE)
        iteration = ckpt.mimo.iteration
        assert iteration == resume_at, f"the checkpoint holds iteration {iteration}, saved {resume_at}"
        out["losses"] = train(resume_at + 1, steps)
    out["state"] = snapshot(built, scheduler)
    return out


def run(rank, world_size, cfg, phase, ckpt_dir, steps, resume_at, device="cpu"):
    """One rank of one run, as :func:`..testing.gpt_job.run` (the same phases, the same result), in the GPT job's
    surroundings (:func:`..testing.gpt_job.worker`), each module on the rank's GPU in a cuda run (placement)."""
    from ..testing import placement
    from ..testing._fused_adam import path_in_use

    assert world_size == cfg.world == 2, f"{cfg.name} runs on 2 ranks, got {world_size}"
    on = "cuda" if job.runs_on_gpu(device) else "cpu"
    with job.worker(cfg, device) as cpu_gen, placement.on(on):
        out = _run_phase(phase, ckpt_dir, steps, resume_at, cpu_gen)
        out["optimizer"] = path_in_use()
        return out
