"""One rank of a resume-check run that checkpoints through ms-swift's own Megatron checkpoint functions.

The job trains as :mod:`..testing.gpt_job` does (Megatron's arguments, ``GPTModel`` with local layers and one
expert per EP rank, ``Float16Module``, Megatron's ``DistributedDataParallel``, the distributed
optimizer, the scheduler, the same batches, dropout and router noise), set up as ms-swift sets up a
Megatron run: ``swift.megatron.utils.megatron_lm_utils.initialize_megatron`` builds the parallel
state, seeds (``mcore_bridge.set_random_seed``) and sets the MoE aux-loss scale. The checkpoint is
ms-swift's: run B saves with ``save_mcore_checkpoint`` (model, optimizer, scheduler and ms-swift's
own RNG entry, ``_get_rng_state``; ``dist_checkpointing`` with ``torch_dist`` through its fully
parallel save strategy) and run C loads with ``load_mcore_checkpoint`` (which restores model,
optimizer, scheduler and the RNG states itself), as ms-swift's trainer calls them.

What is not ms-swift's own here: its arguments are an ``argparse.Namespace`` with the fields these
functions read (``MegatronArguments`` needs a Hugging Face model directory to build), describing this
job (its parallel sizes, the distributed optimizer and its checkpoint format, bf16), at ms-swift's
defaults otherwise; the model is built by :mod:`..testing.gpt_job` (ms-swift builds it from a Hugging Face config
through mcore-bridge).

Stand-ins, besides :mod:`..testing.gpt_job`'s (test and selftest processes only, never by ``import mcore_ckpt_fixes``):

* Transformer Engine, for importing ms-swift on a host without it (mcore-bridge imports it at import
  time; it cannot be installed without CUDA): the stand-in around ``mcore_bridge``'s import only, of
  :func:`mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift.import_swift` (nothing of Transformer
  Engine runs here);
* ``mcore_bridge.set_random_seed`` seeds Megatron's RNG tracker only where it sees a GPU: on a CPU
  host the job makes the call it makes there (same seed formula).

The CUDA buffers ms-swift's load allocates (the iteration it all-reduces, the fully parallel load's
shard exchange) are CPU tensors under :mod:`..testing.gpt_job`'s ``cuda_to_cpu_mode``.

ms-swift's import patches torch's DCP reader process-wide: the check imports it in the process that
forks the ranks (:func:`prepare`), which the tests keep apart from their own process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import warnings

import torch
import torch.distributed as dist

from ..testing import gpt_job as job
from ..testing.quiet import quiet

MODULE = "swift.megatron.utils.megatron_lm_utils"


def _installed() -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("swift", "mcore_bridge"))
    except (ImportError, ValueError):
        return False


def prepare() -> None:
    """In the parent, before any world: import ms-swift once (with the Transformer Engine stand-in
    where TE is not installed), so that the forked ranks start warm. Where ms-swift is not installed
    nothing is imported; the configuration then says why it is not applicable."""
    if not _installed():
        return
    with contextlib.suppress(ImportError):
        from ..fixes.rng_under_ep.checks.ms_swift import import_swift

        with quiet():
            import_swift()


def _swift_args(cfg, ckpt_dir):
    """The fields of ms-swift's ``MegatronArguments`` that ``initialize_megatron``,
    ``save_mcore_checkpoint`` and ``load_mcore_checkpoint`` read, describing this job."""
    return argparse.Namespace(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        expert_model_parallel_size=cfg.ep or 1,
        expert_tensor_parallel_size=1,
        ddp_backend="gloo",
        ddp_timeout=18000000,
        seed=job.SEED,
        te_rng_tracker=False,
        data_parallel_random_init=False,
        model_info=argparse.Namespace(is_moe_model=bool(cfg.ep)),
        output_dir=ckpt_dir,
        mcore_model=ckpt_dir,
        async_save=False,
        use_megatron_fsdp=False,
        dist_ckpt_save_pre_mcore_014=False,
        dist_ckpt_optim_fully_reshardable=cfg.optim_format == "fully_reshardable",
        distrib_optim_fully_reshardable_mem_efficient=False,
        no_save_optim=False,
        no_load_optim=False,
        no_save_rng=False,
        no_load_rng=False,
        finetune=False,
        tuner_type="full",
        use_distributed_optimizer=cfg.distributed_optimizer,
        fp16=False,
        bf16=True,
    )


def _initialize(m, sargs):
    """ms-swift's ``initialize_megatron``; on CPU also the tracker, which ``mcore_bridge``'s
    ``set_random_seed`` seeds only where it sees a GPU (its seed formula, PP=1)."""
    from megatron.core import tensor_parallel

    with quiet():
        m.initialize_megatron(sargs)
    if not torch.cuda.device_count():
        tensor_parallel.model_parallel_cuda_manual_seed(sargs.seed)


def _load(m, sargs, model, optimizer, scheduler):
    """ms-swift's load; the warnings it raised (recorded: a load that reads an older layout says so)."""
    with warnings.catch_warnings(record=True) as caught, quiet():
        warnings.simplefilter("always")
        iteration = m.load_mcore_checkpoint(sargs, [model], optimizer, scheduler, load_arg="mcore_model")
    return iteration, [f"{w.category.__name__}: {w.message}" for w in caught]


def _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen):
    from ..fixes.rng_under_ep.checks.ms_swift import import_swift

    m = import_swift()
    args = job.parse_args(cfg, ckpt_dir, steps)  # Megatron's arguments build the model, as in job.py
    sargs = _swift_args(cfg, ckpt_dir)
    _initialize(m, sargs)
    model, optimizer, scheduler = job.build(args, cfg)
    out = {"coords": job.coords(), "losses": {}}
    if phase == "uninterrupted":
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, 1, steps)
    elif phase == "save":
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, 1, resume_at)
        with quiet():
            m.save_mcore_checkpoint(sargs, [model], optimizer, scheduler, iteration=resume_at, output_dir=ckpt_dir)
        dist.barrier()
        out["losses"].update(
            job.train_steps(model, optimizer, scheduler, args, cpu_gen, resume_at + 1, steps)
        )  # (job.py)
    else:
        iteration, out["load_warnings"] = _load(m, sargs, model, optimizer, scheduler)
        assert iteration == resume_at, f"ms-swift's load_mcore_checkpoint returned {iteration}, saved {resume_at}"
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, resume_at + 1, steps)
    out["state"] = job.snapshot(model, optimizer, scheduler)
    return out


def run(rank, world_size, cfg, phase, ckpt_dir, steps, resume_at, device="cpu"):
    """One rank of one run, as :func:`..testing.gpt_job.run` (the same phases, the same result), checkpointed
    through ms-swift's ``save_mcore_checkpoint`` / ``load_mcore_checkpoint``."""
    assert world_size == cfg.world, f"{cfg.name} runs on {cfg.world} ranks, got {world_size}"
    with job.worker(cfg, device) as cpu_gen:
        return _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen)
