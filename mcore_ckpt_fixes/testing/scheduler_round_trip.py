"""The round trip the scheduler fixes share (scheduler-override-group-lr, scheduler-checkpoint-wd):
the fix's state recorded, then its two ways of saving and loading the scheduler with the
distributed optimizer, each a function of the fix's ``checks``: through ``dist_checkpointing`` (every
release), and through ``megatron.training``'s ``save_checkpoint`` / ``load_checkpoint`` where the
release ships it. Each records what it compares in the ``RoundTrip``; a difference is raised as
the fix's one message at the end (the release's bug is silent: a world shows it as one error)."""

from __future__ import annotations

import contextlib
import os

from . import dist_optimizer as dopt
from ._fused_adam import optimizer_path
from .gpt_job import training_checkpointing
from .result import RoundTrip
from .states import fix_states


def run(fix_id, module, ckpt_dir, patched, device, through_dist_checkpointing, through_megatron_training, wrong):
    """``through_dist_checkpointing(rt, ckpt_dir)`` and ``through_megatron_training(rt, training,
    ckpt_dir, device)``; ``wrong``: the message of a difference. Returns the round trip's result."""
    rt = RoundTrip()
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(fix_id, (module,), patched)
        rt.phase("save")
        # Megatron's FusedAdam path (Apex's interface, a CPU stand-in here), as on a GPU host: on
        # torch's Adam the fresh optimizer's load needs torch-adam-step, which this world may not have.
        with dopt.world(device), optimizer_path(apex=True):
            rt["device"] = str(dopt.device())
            through_dist_checkpointing(rt, ckpt_dir)
        training = training_checkpointing()
        rt["through"] = "megatron.training" if training is not None else "dist_checkpointing"
        if training is not None:
            rt.phase("save")
            through_megatron_training(rt, training, ckpt_dir, device)
        rt.phase("schedule")
        if rt.differing():
            raise AssertionError(wrong)
    return rt.result


@contextlib.contextmanager
def saved_by_megatron_training(training, cfg, ckpt_dir, device, steps):
    """The resume check's small GPT of ``cfg`` trained ``steps`` steps and saved with
    ``megatron.training``'s ``save_checkpoint`` (under ``ckpt_dir/training``); yields its parsed
    arguments, inside the rank's worker surroundings, for the caller's load."""
    from . import gpt_job as job

    with job.worker(cfg, device) as cpu_gen:
        save_dir = os.path.join(ckpt_dir, "training")
        args, *_ = job.trained_and_saved(training.save_checkpoint, cfg, save_dir, steps, cpu_gen, train_iters=10)
        yield args
