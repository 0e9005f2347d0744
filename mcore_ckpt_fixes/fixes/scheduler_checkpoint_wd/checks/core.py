"""scheduler-checkpoint-wd's round trip, on 2 gloo ranks.

Saved: Megatron's DDP and distributed optimizer (on the FusedAdam path) on a one-layer GPT
(:mod:`....testing.dist_optimizer`) and Megatron's ``OptimizerParamScheduler`` with a weight decay
rising linearly from 0.01 to 0.02 over 10 steps, two real optimizer steps, then
``dist_checkpointing.save`` of the model, the optimizer (``dp_reshardable``; model space before 0.15) and the scheduler's
state. Resumed with ``--use-checkpoint-opt_param-scheduler`` (``use_checkpoint_opt_param_scheduler``),
in ``load_checkpoint``'s order (optimizer, then scheduler): once with other weight-decay arguments
(constant 0.05), once with the saved ones. Expected either way: every param group's lr and weight
decay exactly as the checkpoint's schedule gives them after the saved steps (a scheduler built with
the saved arguments, no load), and again after the scheduler's next step; compared as tensors
(``max_delta``), the groups without weight decay (``wd_mult`` 0) included.

Where the release ships ``megatron.training`` (0.17+), also through ``save_checkpoint`` /
``load_checkpoint`` with the resume check's small GPT: saved with ``--weight-decay 0.01``, the
arguments parsed again with ``--use-checkpoint-opt_param-scheduler --weight-decay 0.05``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import dist_optimizer as dopt
from ....testing import scheduler_round_trip
from ....testing.gpt_job import training_checkpointing
from .. import ID, MODULE

# The weight-decay schedules (scheduler arguments) the round trip saves with and resumes with.
OLD = {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "linear"}
NEW = {"start_wd": 0.05, "end_wd": 0.05, "wd_incr_style": "constant"}
LR = {"max_lr": 0.01, "min_lr": 0.001}
STEPS = 2
# megatron.training: the job saves with its default --weight-decay 0.01; resumed with these.
TRAINING_OLD_WD, TRAINING_NEW_WD = 0.01, 0.05
RESUME_ARGS = ("--use-checkpoint-opt_param-scheduler", "--weight-decay", str(TRAINING_NEW_WD))
WRONG_WD = "the param groups' weight decay after the load is not the checkpoint schedule's"


def prepare() -> None:
    dopt.prepare()
    import megatron.core.optimizer_param_scheduler  # noqa: F401

    training_checkpointing()  # imported in the parent where the release ships it


def _optimizer(model, wd):
    """Megatron's distributed optimizer (Adam) built with this schedule's starting weight decay (and
    the learning rates the scheduler has: the groups carry them as their max_lr / min_lr)."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = dopt.optimizer_config(weight_decay=wd["start_wd"], lr=LR["max_lr"], min_lr=LR["min_lr"])
    return get_megatron_optimizer(config, [model])


def _scheduler(opt, wd, use_checkpoint):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=LR["max_lr"], min_lr=LR["min_lr"], lr_warmup_steps=1, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=wd["start_wd"], end_wd=wd["end_wd"], wd_incr_steps=10,
        wd_incr_style=wd["wd_incr_style"], use_checkpoint_opt_param_scheduler=use_checkpoint,
    )  # fmt: skip


def groups(opt):
    """Each param group's lr and weight decay, as tensors (compared bit for bit)."""
    return {
        f"group{i}/{k}": torch.tensor(float(g[k]), dtype=torch.float64)
        for i, g in enumerate(opt.param_groups)
        for k in ("lr", "weight_decay")
    }


def weight_decays(opt) -> list:
    return [float(g["weight_decay"]) for g in opt.param_groups]


def _scheduled(wd, steps):
    """A fresh optimizer's groups as a scheduler with ``wd`` sets them after ``steps``, no load."""
    opt = _optimizer(dopt.build_model(3), wd)
    sched = _scheduler(opt, wd, use_checkpoint=False)
    sched.step(increment=steps)
    return opt, sched


def _save(path):
    from megatron.core import dist_checkpointing

    model = dopt.build_model(1)
    opt = _optimizer(model, OLD)
    sched = _scheduler(opt, OLD, use_checkpoint=False)
    for i in range(STEPS):
        dopt.step(model, opt, i)
        sched.step(increment=1)
    state = dopt.request(model, opt, dopt.sharding_type("dp_reshardable"), False)
    dist_checkpointing.save({**state, "opt_param_scheduler": sched.state_dict()}, path)


def _resume(path, wd):
    """A new optimizer and scheduler built with ``wd`` and the checkpoint's schedule, loaded."""
    from megatron.core import dist_checkpointing

    model = dopt.build_model(2)
    opt = _optimizer(model, wd)
    sched = _scheduler(opt, wd, use_checkpoint=True)
    loaded = dist_checkpointing.load(dopt.request(model, opt, dopt.sharding_type("dp_reshardable"), True), path)
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(dist_checkpointing.load_common_state_dict(path)["opt_param_scheduler"])
    return opt, sched


def _through_dist_checkpointing(rt, ckpt_dir):
    path = os.path.join(ckpt_dir, "dist")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    _save(path)
    rt.phase("load")
    reference, ref_sched = _scheduled(OLD, STEPS)
    rt["weight_decay"] = {"checkpoint": weight_decays(reference), "arguments": weight_decays(_scheduled(NEW, STEPS)[0])}
    opt, sched = _resume(path, NEW)
    rt["weight_decay"]["dist"] = weight_decays(opt)
    rt.compare(groups(reference), groups(opt), prefix="dist/")
    same, _ = _resume(path, OLD)  # arguments unchanged: what the release gets right
    rt.compare(groups(reference), groups(same), prefix="dist-same/")
    sched.step(increment=1)  # the scheduler's next step: the checkpoint's weight decay, fixed or not
    ref_sched.step(increment=1)
    rt.compare(groups(reference), groups(opt), prefix="dist-next/")


def _through_megatron_training(rt, training, ckpt_dir, device):
    from megatron.training import global_vars

    from ....testing import gpt_job as job
    from ....testing.job_config import Config

    cfg = Config("dense-dp2", "dense GPT, DP=2", world=2)
    with scheduler_round_trip.saved_by_megatron_training(training, cfg, ckpt_dir, device, STEPS) as args:
        rt.phase("load")
        _, reference, ref_scheduler = job.build(args, cfg)  # the saved arguments' schedule, no load
        ref_scheduler.step(increment=STEPS * args.global_batch_size)
        global_vars.unset_global_variables()  # parsed again, as a resumed job's new process does
        args = job.parse_args(cfg, os.path.join(ckpt_dir, "training"), 10, RESUME_ARGS)
        _, by_arguments, new_scheduler = job.build(args, cfg)  # the new arguments' schedule, no load
        new_scheduler.step(increment=STEPS * args.global_batch_size)
        model, optimizer, scheduler = job.build(args, cfg)
        training.load_checkpoint([model], optimizer, scheduler)
        rt["weight_decay"].update(
            training=weight_decays(optimizer),
            training_checkpoint=weight_decays(reference),
            training_arguments=weight_decays(by_arguments),
        )
        rt.compare(groups(reference), groups(optimizer), prefix="training/")


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    return scheduler_round_trip.run(
        ID, MODULE, ckpt_dir, patched, device, _through_dist_checkpointing, _through_megatron_training, WRONG_WD
    )
