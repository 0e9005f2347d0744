"""ep-change-optimizer-chain's round trip on 2 gloo ranks: a MoE GPT (two experts, Megatron's DDP,
the distributed optimizer saved ``fully_reshardable``, :mod:`mcore_ckpt_fixes.testing.gpt_job`)
trained under EP=2 and saved by ``megatron.training``'s ``save_checkpoint``; the same ranks then
build the job under EP=1 (DP=2: one optimizer for all parameters), ``load_checkpoint`` it and save
what they loaded at once; and back: a job under EP=2 loads that EP=1 checkpoint and saves again.

Each load is compared with what was saved as full tensors (every tensor of both checkpoints at its
global shape, read through DCP: the parameters, fp32 main parameters and Adam moments, keyed by
parameter whatever the layout), with the scheduler, the iteration and the optimizers' parameter
groups (their ``step``; by kind, as the two jobs chain another number of optimizers); each rank compares its share
of the keys. After each load the job trains one step (a load that leaves the optimizer unusable
fails there). Phases: ``save``, ``load`` (EP 2 -> 1), ``load back`` (EP 1 -> 2).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ....testing import gpt_job as job
from ....testing.full_state import (
    chain_length,
    common_state,
    full_tensors,
    latest_iteration_dir,
    optimizer_state_by_kind,
)
from ....testing.job_config import moe_for_layout_change
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE


EP2, EP1 = moe_for_layout_change("moe-ep2", 2, 2), moe_for_layout_change("moe-ep1-dp2", 2, 1)
ITERATION = 2
SCHEDULER = "opt_param_scheduler"

prepare = job.prepare_training


def _build(cfg, load_dir, save_dir, cpu_gen):
    """The job of ``cfg`` built as a new process builds it (arguments parsed again, parallel state
    set up for its layout): (args, model, optimizer, scheduler, feed)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    destroy_rerun_state_machine()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    args = job.parse_args(cfg, load_dir, ITERATION + 2)
    args.save = save_dir
    job.initialize_parallel(cfg, args)
    return (args, *job.start(cfg, args, cpu_gen))


def _save(args, model, optimizer, scheduler, iteration):
    from megatron.training.checkpointing import save_checkpoint

    save_checkpoint(iteration, job.chunks(model), optimizer, scheduler, 0)
    dist.barrier()


def _reload(rt, cfg, saved_dir, resaved_dir, cpu_gen):
    """Build ``cfg``, load ``saved_dir``, save what was loaded into ``resaved_dir``, compare, train a step."""
    from megatron.training.checkpointing import load_checkpoint

    args, model, optimizer, scheduler, feed = _build(cfg, saved_dir, resaved_dir, cpu_gen)
    iteration, _ = job.load(load_checkpoint, model, optimizer, scheduler)
    rt[f"iteration/{cfg.name}"] = iteration
    _save(args, model, optimizer, scheduler, iteration)
    _compare(rt, saved_dir, resaved_dir, cfg.name)
    job.train_steps(model, optimizer, scheduler, args, feed, iteration + 1, iteration + 1)


def _compare(rt, saved_root, loaded_root, name):
    saved_dir, loaded_dir = latest_iteration_dir(saved_root), latest_iteration_dir(loaded_root)
    saved, loaded = full_tensors(saved_dir), full_tensors(loaded_dir)
    if set(saved) != set(loaded):
        raise AssertionError(f"{name}: keys differ: {sorted(set(saved) ^ set(loaded))[:8]}")
    share = sorted(saved)[dist.get_rank() :: dist.get_world_size()]
    rt.compare({k: saved[k] for k in share}, {k: loaded[k] for k in share}, prefix=f"{name}/")
    a, b = common_state(saved_dir), common_state(loaded_dir)
    for key in ("iteration", SCHEDULER):
        if a.get(key) != b.get(key):
            raise AssertionError(f"{name}: common state {key!r} differs: {a.get(key)!r} vs {b.get(key)!r}")
    # The optimizers' own common state (their groups' step and hyperparameters), chained as each job chains them.
    if optimizer_state_by_kind(a["optimizer"]) != optimizer_state_by_kind(b["optimizer"]):
        raise AssertionError(
            f"{name}: the optimizer's common state differs: {optimizer_state_by_kind(a['optimizer'])} vs "
            f"{optimizer_state_by_kind(b['optimizer'])}"
        )
    rt[f"chain/{name}"] = (chain_length(a["optimizer"]), chain_length(b["optimizer"]))


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    rt = RoundTrip()
    ep2_dir, ep1_dir, back_dir = (os.path.join(ckpt_dir, d) for d in ("ep2", "ep1", "ep2-again"))
    with rt.running(), job.worker(EP2, device) as cpu_gen:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        args, model, optimizer, scheduler, feed = _build(EP2, ep2_dir, ep2_dir, cpu_gen)
        rt["device"] = str(next(job.chunks(model)[0].parameters()).device)
        job.train_steps(model, optimizer, scheduler, args, feed, 1, ITERATION)
        _save(args, model, optimizer, scheduler, ITERATION)
        del model, optimizer, scheduler, feed
        rt.phase("load")
        _reload(rt, EP1, ep2_dir, ep1_dir, cpu_gen)
        rt.phase("load back")
        _reload(rt, EP2, ep1_dir, back_dir, cpu_gen)
    return rt.result
