"""strictness-return-keys' round trip: ``megatron.training.checkpointing``'s own ``save_checkpoint`` and
``load_checkpoint`` on 2 gloo ranks, the resume check's dense GPT (DP=2, Megatron's DDP, distributed
optimizer ``dp_reshardable`` on the FusedAdam path, scheduler: :mod:`mcore_ckpt_fixes.testing.gpt_job`
and its CPU stand-ins).

Phases: ``save`` (one training step, ``save_checkpoint`` at iteration 1; this rank's whole state
recorded); ``load``: the job built anew (Megatron's arguments parsed again with each way's options, a
new model, optimizer and scheduler) and ``load_checkpoint`` run once per way of :data:`WAYS`, each
way's outcome recorded (``"ok"`` or the error line) with the iteration it returned and the WARNING
lines logged during it (``logged``: ``fix``, this fix's, from its runtime or from the source diff in
Megatron's module; ``release``, dist_checkpointing's own); each way that loads is compared with
what was saved: every tensor and number of the model, optimizer, scheduler and RNG state (the model
alone where the optimizer is not loaded). The first way that failed is raised at the end of phase
``load``, so that a world shows the bug as one error.
"""

from __future__ import annotations

import os

from ....testing import gpt_job as job
from ....testing.job_config import Config
from ....testing.logged import Warnings
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

CONFIG = Config("dense-dp2", "dense GPT, DP=2, distributed optimizer (dp_reshardable)", world=2)
ITERATION = 1
# How the job is resumed: the two values that return the keys (no key mismatches here), then a
# request without the optimizer (--no-load-optim: the checkpoint's optimizer state is asked for by
# no rank) under return_all and, for what the release itself reports, log_all.
WAYS = (
    ("--dist-ckpt-strictness", "return_unexpected"),
    ("--dist-ckpt-strictness", "return_all"),
    ("--dist-ckpt-strictness", "return_all", "--no-load-optim"),
    ("--dist-ckpt-strictness", "log_all", "--no-load-optim"),
)
# Where the fix's warning comes from: its runtime, or the source diff's text in Megatron's module.
FIX_LOGGERS = ("mcore_ckpt_fixes", MODULE)
RELEASE_LOGGER = "megatron.core.dist_checkpointing"


def way_name(way) -> str:
    return " ".join(a for a in way if a != "--dist-ckpt-strictness")


# The scenario's prepare, and this rank's state as tensors.
prepare = job.prepare_training
state = job.snapshot_tensors


def _load(checkpointing, save_dir, way):
    """A job built anew with ``way``'s options loads the checkpoint: (iteration, its state, warnings)."""
    args, model, optimizer, scheduler = job.built_anew(CONFIG, save_dir, way)
    with Warnings(FIX_LOGGERS, RELEASE_LOGGER) as warned:
        iteration, _ = job.load(checkpointing.load_checkpoint, model, optimizer, scheduler)
    return iteration, state(model, optimizer, scheduler, model_only=args.no_load_optim), warned.lines


def _load_each_way(rt, checkpointing, save_dir, saved):
    """Every way's outcome; the first failure, if any, is returned to be raised."""
    first = None
    for way in WAYS:
        name = way_name(way)
        try:
            iteration, loaded, rt["logged"][name] = _load(checkpointing, save_dir, way)
        except Exception as exc:
            rt["outcomes"][name] = f"{type(exc).__name__}: {exc}"
            first = first or exc
            continue
        rt["outcomes"][name], rt["iteration"][name] = "ok", iteration
        rt.compare({k: saved[k] for k in loaded}, loaded, prefix=f"{name}/")
        rt.phase("load")
    return first


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.training import checkpointing

    rt = RoundTrip(outcomes={}, iteration={}, logged={})
    save_dir = os.path.join(ckpt_dir, "training")
    with rt.running(), job.worker(CONFIG, device) as cpu_gen:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        _, model, optimizer, scheduler = job.trained_and_saved(
            checkpointing.save_checkpoint, CONFIG, save_dir, ITERATION, cpu_gen
        )
        rt["device"] = str(next(model.parameters()).device)  # the job's GPU where there is one
        saved = state(model, optimizer, scheduler)
        rt.phase("load")
        first = _load_each_way(rt, checkpointing, save_dir, saved)
        if first is not None:
            raise first
    return rt.result
