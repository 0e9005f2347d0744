"""legacy-save-writers' round trip: ``megatron.training.checkpointing``'s own ``save_checkpoint`` and
``load_checkpoint`` in the legacy ``torch`` format, on 2 gloo ranks laid out TP=2, EP=1, expert TP=1
(expert-DP size 2: TP rank 1 has expert-DP rank 1), with the resume check's MoE GPT, DDP, distributed
optimizer and scheduler (:mod:`mcore_ckpt_fixes.testing.gpt_job`, configuration ``moe-tp2-etp1-legacy``,
and its CPU stand-ins).

Phases: ``save`` (one training step, ``save_checkpoint`` at iteration 1); ``files`` (every rank: each rank's
``mp_rank_*/model_optim_rng.pt``, as ``get_checkpoint_name`` names it for that rank, is on disk; one
``AssertionError`` line naming what is missing otherwise); ``load`` (the parameters are overwritten,
``load_checkpoint`` reads them back); then every parameter is compared with what was saved
(``max_delta``); ``shared`` (in the same world, DP=2 with TP=1, where both ranks' files have one
name: a second save, during which each rank's ``torch.save`` calls are recorded; one
``AssertionError`` line if two ranks wrote one file). ``writers`` holds, for both saves, which
ranks wrote which file.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing import gpt_job as job
from ....testing.job_config import Config
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

# The resume check's configuration of that name (mcore_ckpt_fixes/resume/configs.py), built here.
CONFIG = Config(
    "moe-tp2-etp1-legacy",
    "MoE GPT, TP=2 with EP=1 and expert TP=1 on 2 ranks (sequence parallel), legacy torch format",
    world=2,
    tp=2,
    ep=1,
    etp=1,
    ckpt_format="torch",
)
ITERATION = 1


def prepare():
    """Import in the parent what every rank uses, once."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.training  # noqa: F401


def _params(model):
    return {f"model/{n}": p.detach().float().clone() for n, p in model.module.named_parameters()}


def _missing(checkpointing, save_dir):
    """The files some rank's load will ask for that the save did not write (relative paths)."""
    own = checkpointing.get_checkpoint_name(save_dir, ITERATION)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, own)
    return sorted({os.path.relpath(n, save_dir) for n in names if not os.path.exists(n)})


# Then, in the same world, DP=2 (TP=1): both ranks' files have one name, mp_rank_00.
SHARED = Config(
    "dense-dp2-legacy",
    "dense GPT, DP=2 on 2 ranks, legacy torch format (both ranks name one file)",
    world=2,
    ckpt_format="torch",
)
CHECKPOINT_FILE = "model_optim_rng.pt"


class _Writers:
    """Which checkpoint files this rank's ``torch.save`` calls wrote during the block (relative to
    ``root``); test instrumentation of this worker only."""

    def __init__(self, root):
        self.root, self.paths = root, []

    def __enter__(self):
        self.save = torch.save

        def recording_save(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and os.path.basename(f) == CHECKPOINT_FILE:
                self.paths.append(os.path.relpath(f, self.root))
            return self.save(obj, f, *args, **kwargs)

        torch.save = recording_save
        return self

    def __exit__(self, *exc):
        torch.save = self.save

    def by_file(self):
        """{file: [global ranks that wrote it]} over every rank."""
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, self.paths)
        out = {}
        for r, paths in enumerate(every):
            for path in paths:
                out.setdefault(path, []).append(r)
        return dict(sorted(out.items()))


def _save(checkpointing, cfg, save_dir, tp, cpu_gen):
    """Train one step in ``cfg``'s layout (TP=``tp``, the rest data parallel) and save it at
    ITERATION; returns the model and its parameters as saved, and who wrote which file."""
    from megatron.core import parallel_state as mpu

    args = job.parse_args(cfg, save_dir, 2)  # 2 steps: the scheduler warms up for 1
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=1)
    job.seed(args)
    model, optimizer, scheduler = job.build(args, cfg)
    job.train_step(model, optimizer, scheduler, args, cpu_gen)  # an optimizer with state to save
    with _Writers(save_dir) as writers:
        checkpointing.save_checkpoint(ITERATION, [model], optimizer, scheduler, 0)
    return (model, optimizer, scheduler), _params(model), writers.by_file()


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing

    rt = RoundTrip(case="tp2_ep1_etp1", sharding_type="legacy", steps=None)
    save_dir = os.path.join(ckpt_dir, "legacy")
    with rt.running(), job.worker(CONFIG, device) as cpu_gen:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        (model, optimizer, scheduler), saved, writers = _save(checkpointing, CONFIG, save_dir, 2, cpu_gen)
        rt["device"] = str(next(model.parameters()).device)  # the job's GPU where there is one
        rt["layout"] = {"tp": mpu.get_tensor_model_parallel_rank(), "expert_dp": mpu.get_expert_data_parallel_rank()}
        rt.phase("files")
        missing = _missing(checkpointing, save_dir)
        if missing:
            raise AssertionError(f"the save wrote no {', '.join(missing)}")
        rt.phase("load")
        with torch.no_grad():
            for p in model.module.parameters():
                p.fill_(0)
        iteration, _ = job.load(checkpointing.load_checkpoint, model, optimizer, scheduler)
        assert iteration == ITERATION, iteration
        rt.compare(saved, _params(model))
        rt.phase("shared")
        from megatron.training import global_vars

        mpu.destroy_model_parallel()
        global_vars.unset_global_variables()
        shared_dir = os.path.join(ckpt_dir, "shared")
        _, _, shared_writers = _save(checkpointing, SHARED, shared_dir, 1, cpu_gen)
        rt["writers"] = {"tp2": writers, "dp2": shared_writers}
        twice = {f: ranks for f, ranks in shared_writers.items() if len(ranks) > 1}
        if twice:
            raise AssertionError(f"more than one rank wrote one checkpoint file: {twice}")
    return rt.result
