"""scheduler-override-group-lr's round trip, on 2 gloo ranks.

Saved: Megatron's DDP and distributed optimizer (on the FusedAdam path) on a one-layer GPT (:mod:`....testing.dist_optimizer`)
with ``--lr 0.01 --min-lr 0.001 --decoupled-lr 0.03`` (the embedding and output layer's own group)
and Megatron's ``OptimizerParamScheduler`` (cosine, warm-up 1 of 10 steps), two real optimizer
steps, then ``dist_checkpointing.save`` of the model, the optimizer (``dp_reshardable``; model space before 0.15) and the
scheduler's state. Resumed: a new optimizer and scheduler with ``--lr 0.02 --min-lr 0.002
--decoupled-lr 0.05`` and ``--override-opt-param-scheduler``, loaded in ``load_checkpoint``'s order
(optimizer, then scheduler). Expected: every param group's ``max_lr``, ``min_lr`` and ``lr`` exactly as
a scheduler with the new arguments gives them after the saved number of steps, with no load (a run
that trained with that schedule from the same state); compared as tensors (``max_delta``), the
decoupled group keeping its own values.

Where the release ships ``megatron.training`` (0.17+), also through ``save_checkpoint`` /
``load_checkpoint`` with the resume check's small GPT (``--decoupled-lr``, the distributed optimizer),
the arguments changed between the save and the load as a user changes them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import dist_optimizer as dopt
from ....testing import scheduler_round_trip
from ....testing.gpt_job import training_checkpointing
from .. import ID, MODULE

OLD = {"lr": 0.01, "min_lr": 0.001, "decoupled_lr": 0.03}
NEW = {"lr": 0.02, "min_lr": 0.002, "decoupled_lr": 0.05}
STEPS = 2
WRONG_SCHEDULE = "the param groups' max_lr/min_lr/lr after the load are not the new schedule's"


def prepare() -> None:
    dopt.prepare()
    import megatron.core.optimizer_param_scheduler  # noqa: F401

    training_checkpointing()  # imported in the parent where the release ships it


def groups_told_apart_by_learning_rate() -> bool:
    """0.19 matches saved param groups by max_lr / min_lr: there the decoupled group is alike the
    default one but for them, and after a change of both learning rates no key tells which saved
    group is whose (the load stops, fixes or not: param-group-identity matches a changed learning
    rate only where the groups differ otherwise). The round trip then keeps one learning rate."""
    from megatron.core.optimizer import optimizer

    return "max_lr" in tuple(tuple.__iter__(getattr(optimizer, "param_group_identifier_keys", ())))


def lrs(which):
    """``OLD`` or ``NEW``, without the decoupled group where groups are told apart by learning rate."""
    return {**which, "decoupled_lr": None} if groups_told_apart_by_learning_rate() else dict(which)


def changed_lr_loads():
    """None where Megatron's optimizers load param groups saved with another learning rate, else why
    the scenario cannot run here (0.19 with param-group-identity off: the load stops, as catalogued
    in lr-change-resume-group-mismatch)."""
    import mcore_ckpt_fixes

    if not groups_told_apart_by_learning_rate():
        return None
    state = next(r for r in mcore_ckpt_fixes.report() if r["id"] == "param-group-identity")["state"]
    if state in ("applied", "already-applied"):
        return None
    return (
        "this release's optimizers match saved param groups by max_lr / min_lr and param-group-identity is "
        f"{state}: a load with a changed --lr stops before the scheduler (known bug lr-change-resume-group-mismatch)"
    )


def _optimizer(model, lrs):
    """Megatron's distributed optimizer (Adam) with these learning rates."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = dopt.optimizer_config(decoupled_lr=lrs["decoupled_lr"])
    config.lr, config.min_lr = lrs["lr"], lrs["min_lr"]
    return get_megatron_optimizer(config, [model])


def _scheduler(opt, lrs, override):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lrs["lr"], min_lr=lrs["min_lr"], lr_warmup_steps=1, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not override, override_opt_param_scheduler=override,
    )  # fmt: skip


def groups(opt):
    """Each param group's max_lr, min_lr and lr, as tensors (compared bit for bit)."""
    return {
        f"group{i}/{k}": torch.tensor(float(g[k]), dtype=torch.float64)
        for i, g in enumerate(opt.param_groups)
        for k in ("max_lr", "min_lr", "lr")
    }


def _through_dist_checkpointing(rt, ckpt_dir):
    """The model, the optimizer (``dp_reshardable``; model space before 0.15) and the scheduler's state saved with
    ``dist_checkpointing``, loaded in ``load_checkpoint``'s order (the optimizer, then the scheduler)."""
    from megatron.core import dist_checkpointing

    path = os.path.join(ckpt_dir, "dist")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    model = dopt.build_model(1)
    opt = _optimizer(model, lrs(OLD))
    sched = _scheduler(opt, lrs(OLD), override=False)
    for i in range(STEPS):
        dopt.step(model, opt, i)
        sched.step(increment=1)
    state = dopt.request(model, opt, dopt.sharding_type("dp_reshardable"), False)
    dist_checkpointing.save({**state, "opt_param_scheduler": sched.state_dict()}, path)
    rt.phase("load")
    model = dopt.build_model(2)
    opt = _optimizer(model, lrs(NEW))
    sched = _scheduler(opt, lrs(NEW), override=True)
    loaded = dist_checkpointing.load(dopt.request(model, opt, dopt.sharding_type("dp_reshardable"), True), path)
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(dist_checkpointing.load_common_state_dict(path)["opt_param_scheduler"])
    reference = _optimizer(dopt.build_model(3), lrs(NEW))
    _scheduler(reference, lrs(NEW), override=True).step(increment=STEPS)
    rt["groups"] = {k: float(v) for k, v in groups(opt).items()}
    rt.compare(groups(reference), groups(opt), prefix="dist/")


def _through_megatron_training(rt, training, ckpt_dir, device):
    from ....testing import gpt_job as job
    from ....testing.job_config import Config

    cfg = Config("dense-dp2", "dense GPT, DP=2", world=2, decoupled_lr=lrs(OLD)["decoupled_lr"])
    with scheduler_round_trip.saved_by_megatron_training(training, cfg, ckpt_dir, device, STEPS) as args:
        rt.phase("load")
        new = lrs(NEW)
        args.lr, args.min_lr, args.decoupled_lr = new["lr"], new["min_lr"], new["decoupled_lr"]
        args.override_opt_param_scheduler, args.use_checkpoint_opt_param_scheduler = True, False
        model, optimizer, scheduler = job.build(args, cfg)
        training.load_checkpoint([model], optimizer, scheduler)
        _, reference, ref_scheduler = job.build(args, cfg)
        ref_scheduler.step(increment=STEPS * args.global_batch_size)
        rt.compare(groups(reference), groups(optimizer), prefix="training/")


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    return scheduler_round_trip.run(
        ID, MODULE, ckpt_dir, patched, device, _through_dist_checkpointing, _through_megatron_training, WRONG_SCHEDULE
    )
