"""param-group-identity's round trip: Megatron's DDP and distributed optimizer
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`) built by ``get_megatron_optimizer`` with a
decoupled learning rate (Megatron-LM's ``--decoupled-lr``: the embedding and output layer's group
gets its own ``max_lr``), saved and loaded with ``dist_checkpointing`` through the
``ChainedOptimizer`` that function returns and through its ``DistributedOptimizer`` on its own (as
Megatron-FSDP's setup returns one), on 2 gloo ranks (DP=2), on Apex FusedAdam's path (the CPU
stand-in of :mod:`mcore_ckpt_fixes.testing._fused_adam`).

A source run takes ``STEPS`` optimizer steps and saves; a target run (other initial values) builds
Megatron's own load request (``is_loading=True``) and loads. Checked on every rank: every parameter
group's ``max_lr`` and ``min_lr`` after both loads are the source's (phase ``groups``, one
``AssertionError`` line naming each load that differs; the release gives the groups alike but for
``max_lr`` one saved group in both); the main parameters and moments equal what was saved (``max_delta``).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import build, distributed, local_state, placed, request, step, world
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import DISTRIB_MODULE, ID, MODULE

STEPS = 2
SOURCE_SEED, TARGET_SEED = 1234, 98765
DECOUPLED_LR = 3e-2  # the default groups' max_lr is the optimizer's lr, 1e-2
# A resumed run's changed --lr / --min-lr (changed_lr): the saved run's are 1e-2 and 0.
NEW_LRS = {"lr": 2e-2, "min_lr": 2e-3}


def _lrs(opt):
    """Every parameter group's (max_lr, min_lr), in the optimizer's order."""
    return [(g["max_lr"], g["min_lr"]) for d in distributed(opt) for g in d.optimizer.param_groups]


def _save_and_load(source, source_opt, target, target_opt, path):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(request(source, source_opt, "dp_reshardable", False), path)
    loaded = dist_checkpointing.load(request(target, target_opt, "dp_reshardable", True), path)
    target.module.load_state_dict(loaded["model"])
    target_opt.load_state_dict(loaded["optimizer"])


def _round_trip(case, ckpt_dir, patched, source, target, precondition):
    """The source (``build`` with ``source``'s arguments) takes ``STEPS`` steps and saves; targets
    built with ``target``'s arguments load it through the ChainedOptimizer (what load_checkpoint
    loads) and through its DistributedOptimizer on its own (as Megatron-FSDP's setup returns it).
    Every group's (max_lr, min_lr) after both loads must be the source's (phase ``groups``), the
    main parameters and moments what was saved. ``precondition(saved, target)``: asserts on both
    sides' (max_lr, min_lr) what the case is about."""
    rt = RoundTrip(case=case, sharding_type="dp_reshardable", steps=None)
    with rt.running(), optimizer_path(apex=True):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE, DISTRIB_MODULE), patched)
        rt.phase("save")
        model, opt = build(SOURCE_SEED, **source)
        saved_lrs = _lrs(opt)
        for i in range(STEPS):
            step(model, opt, i)
        saved = local_state(model, opt)
        rt["lrs"] = saved_lrs
        rt.phase("load")
        target_model, target_opt = build(TARGET_SEED, **target)
        precondition(saved_lrs, _lrs(target_opt))
        _save_and_load(model, opt, target_model, target_opt, os.path.join(ckpt_dir, "chained"))
        alone, alone_opt = build(TARGET_SEED, **target)
        (source_inner,), (alone_inner,) = distributed(opt), distributed(alone_opt)
        _save_and_load(model, source_inner, alone, alone_inner, os.path.join(ckpt_dir, "alone"))
        rt.phase("groups")
        wrong = [
            f"{how} {_lrs(o)}" for how, o in (("chained", target_opt), ("alone", alone_opt)) if _lrs(o) != saved_lrs
        ]
        if wrong:
            raise AssertionError(
                f"param groups' (max_lr, min_lr) after the load, saved {saved_lrs}: {'; '.join(wrong)}"
            )
        rt.compare(saved, local_state(target_model, target_opt), prefix="chained/")
        rt.compare(saved, local_state(alone, alone_opt), prefix="alone/")
    return rt.result


def _has_decoupled_group(saved, target):
    assert DECOUPLED_LR in {m for m, _ in saved}, saved


def _learning_rate_changed(saved, target):
    assert target != saved, target


def _decoupled_lr(ckpt_dir, patched):
    """Groups alike but for max_lr (--decoupled-lr), the same learning rates on both sides."""
    decoupled = {"decoupled_lr": DECOUPLED_LR}
    return _round_trip("decoupled_lr", ckpt_dir, patched, decoupled, decoupled, _has_decoupled_group)


def _changed_lr(ckpt_dir, patched):
    """The source saved with --lr 1e-2; the targets are built with --lr 2e-2 --min-lr 2e-3 (as a
    resumed run whose learning rate changed): each of its groups (weight decay on, off) must take its
    own saved group, whose state comes back exact; which learning rate the groups then follow is the
    scheduler's to set (``--override-opt-param-scheduler``: the new one, scheduler-override-group-lr;
    ``--use-checkpoint-opt-param-scheduler``: the saved one), so after the load they hold the saved
    group's, as they always did. From 0.19 the release refuses such a load (``KeyError``, phase ``load``)."""
    return _round_trip("changed_lr", ckpt_dir, patched, {}, {"lrs": NEW_LRS}, _learning_rate_changed)


CASES = {"decoupled_lr": _decoupled_lr, "changed_lr": _changed_lr}


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (``names``, default every case): ``{case: result}``."""
    with world(device):
        return {
            name: placed(case(os.path.join(ckpt_dir, name), patched))
            for name, case in CASES.items()
            if name in (names or CASES)
        }


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    with world(device):
        return placed(_decoupled_lr(ckpt_dir, patched))


def changed_lr(rank, world_size, ckpt_dir, patched, device="cpu"):
    with world(device):
        return placed(_changed_lr(ckpt_dir, patched))
