"""model-load-fallback's round trip: ``megatron.training.checkpointing``'s own ``save_checkpoint`` and
``load_checkpoint`` on 2 gloo ranks, the resume check's dense GPT (DP=2, Megatron's DDP over
``Float16Module``, distributed optimizer, tied embeddings: :mod:`mcore_ckpt_fixes.testing.gpt_job`).

Phases: ``save`` (one training step; ``save_checkpoint`` at iteration 1 in ``torch_dist`` and again in
the legacy ``torch`` format; this rank's whole state recorded); ``load``: the job built anew (its
arguments parsed again with each way's options: a new model, optimizer and scheduler) and
``load_checkpoint`` run once per way of :data:`WAYS`. Each way's outcome is recorded (``"ok"`` or
the error line) with the WARNING lines logged during it (``logged``: ``fix`` from the fix's runtime
or, with the source diff, Megatron's module; ``release`` from dist_checkpointing); what it loaded is
compared with what was saved (the model alone where ``--finetune`` leaves the optimizer), and the
weights the checkpoint does not have are listed with whether they kept their initial values
(``kept_initial``). A way that loads and leaves a weight at its initial value that no error and no
log line names is the bug: the phase ends with :data:`SILENT`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ....testing import gpt_job as job
from ....testing.job_config import Config
from ....testing.logged import Warnings
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE
from .scenarios import SILENT

CONFIG = Config("dense-dp2", "dense GPT, DP=2, distributed optimizer (dp_reshardable)", world=2)
LEGACY = Config(
    "dense-dp2-torch", "dense GPT, DP=2, distributed optimizer, legacy torch format", world=2, ckpt_format="torch"
)
ITERATION = 1
# A fine-tuning run that unties the output layer from the embedding: the checkpoint (of the tied
# model) has no output_layer.weight. --finetune: no optimizer to match the new parameter.
UNTIED = ("--untie-embeddings-and-output-weights", "--finetune")
# (name, the checkpoint's format, the options of the job that loads it)
WAYS = (
    ("torch", LEGACY, ()),
    ("torch untied", LEGACY, UNTIED),
    ("torch_dist untied", CONFIG, UNTIED),
    ("torch_dist untied log_all", CONFIG, (*UNTIED, "--dist-ckpt-strictness", "log_all")),
    ("torch_dist untied ignore_all", CONFIG, (*UNTIED, "--dist-ckpt-strictness", "ignore_all")),
)
FIX_LOGGERS = ("mcore_ckpt_fixes", MODULE)
RELEASE_LOGGER = "megatron.core.dist_checkpointing"


# The scenario's prepare, and this rank's state as tensors.
prepare = job.prepare_training
state = job.snapshot_tensors


def _save_both_formats(checkpointing, ckpt_dir, cpu_gen, rt):
    """One step, then the same state saved as torch_dist and as torch; returns that state (and puts
    in ``rt`` the device the job's model lives on: the rank's GPU where there is one)."""
    from megatron.training import global_vars

    save_dir = os.path.join(ckpt_dir, "torch_dist")
    _, model, optimizer, scheduler = job.trained_and_saved(
        checkpointing.save_checkpoint, CONFIG, save_dir, ITERATION, cpu_gen
    )
    rt["device"] = str(next(model.parameters()).device)
    global_vars.unset_global_variables()
    job.parse_args(LEGACY, os.path.join(ckpt_dir, "torch"), 2)  # save_checkpoint reads the format there
    checkpointing.save_checkpoint(ITERATION, [model], optimizer, scheduler, 0)
    dist.barrier()
    return state(model, optimizer, scheduler)


def _load(checkpointing, ckpt_dir, cfg, options):
    """A job built anew with ``options`` loads the checkpoint: (its state, its state before the
    load, the warnings logged)."""
    args, model, optimizer, scheduler = job.built_anew(cfg, os.path.join(ckpt_dir, cfg.ckpt_format), options)
    initial = state(model, optimizer, scheduler, model_only=True)
    with Warnings(FIX_LOGGERS, RELEASE_LOGGER) as warned:
        job.load(checkpointing.load_checkpoint, model, optimizer, scheduler)
    return state(model, optimizer, scheduler, model_only=args.finetune), initial, warned.lines


def model_key(name: str) -> str:
    """The key torch's load names for a snapshot's ``param:module.<key>``."""
    return name.partition(":")[2].removeprefix("module.")


def _load_each_way(rt, checkpointing, ckpt_dir, saved):
    """Every way's outcome and comparison; whether some way dropped a weight silently."""
    silent = False
    for name, cfg, options in WAYS:
        try:
            loaded, initial, rt["logged"][name] = _load(checkpointing, ckpt_dir, cfg, options)
        except (Exception, CheckpointException) as exc:  # torch's is a BaseException
            rt["outcomes"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        rt["outcomes"][name] = "ok"
        rt.compare(
            {k: saved[k] for k in loaded if k in saved},
            {k: v for k, v in loaded.items() if k in saved},
            prefix=f"{name}/",
        )
        absent = sorted(k for k in loaded if k not in saved)
        kept = [k for k in absent if torch.equal(loaded[k], initial[k])]
        rt["kept_initial"][name] = kept
        said = " ".join(rt["logged"][name]["fix"] + rt["logged"][name]["release"])
        silent = silent or any(model_key(k) not in said for k in kept)
        rt.phase("load")
    return silent


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.training import checkpointing

    rt = RoundTrip(outcomes={}, logged={}, kept_initial={})
    with rt.running(), job.worker(CONFIG, device) as cpu_gen:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        saved = _save_both_formats(checkpointing, ckpt_dir, cpu_gen, rt)
        rt.phase("load")
        if _load_each_way(rt, checkpointing, ckpt_dir, saved):
            raise AssertionError(SILENT.partition(": ")[2])
    return rt.result
