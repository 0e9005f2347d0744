"""One rank of a resume-check run that checkpoints through verl's own ``MegatronCheckpointManager``.

The job trains as :mod:`..testing.gpt_job` does (Megatron's arguments, ``GPTModel`` with local layers and one
expert per EP rank, ``Float16Module``, Megatron's ``DistributedDataParallel``, the distributed
optimizer, the scheduler, the same batches, dropout and router noise), seeded as verl seeds a
Megatron worker (``verl.workers.engine.megatron.utils.set_random_seed``). The checkpoint is verl's:
a real ``MegatronCheckpointManager`` built as verl's Megatron engine builds it (``save_contents`` =
``load_contents`` = model, optimizer, extra; ``use_dist_checkpointing``, the distributed optimizer,
``use_checkpoint_opt_param_scheduler``), whose ``save_checkpoint`` writes ``model/``, ``optimizer/``
(with the scheduler) and ``extra/`` (the RNG states) under ``global_step_<K>/actor`` and whose
``load_checkpoint`` reads them back, as verl's trainer calls them.

``use_checkpoint_opt_param_scheduler`` is on: with verl's default (off) the manager does not load
the scheduler, so a resumed run starts its learning-rate schedule again (the check then finds the
scheduler's step count, the parameters and the moments different on every rank).

Stand-ins, besides :mod:`..testing.gpt_job`'s (test and selftest workers only):

* verl's device probes in the manager's module (``get_device_name``, ``is_device_available``,
  ``get_torch_device``): on a CPU host they answer "no accelerator", so verl would save no CUDA
  generator state, while on a GPU it saves and restores it. Here they answer as on a CUDA host, with
  ``torch.cuda``'s RNG functions those of the stand-in generator (:mod:`mcore_ckpt_fixes.testing._rng_standin`), which hidden
  dropout draws from;
* verl seeds Megatron's RNG tracker only where it sees an accelerator: on a CPU host the job makes
  the call verl makes there (``model_parallel_cuda_manual_seed(seed)``).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist

from ..testing import gpt_job as job
from ..testing.quiet import quiet

MODULE = "verl.utils.checkpoint.megatron_checkpoint_manager"


def prepare() -> None:
    """In the parent, before any world: import verl once, so that the forked ranks start warm. Where
    verl is not installed nothing is imported; the configuration then says why it is not applicable."""
    with contextlib.suppress(ImportError):
        from ..fixes.rng_under_ep.checks.verl import prepare as prepare_verl

        prepare_verl()
        import verl.workers.engine.megatron.utils  # noqa: F401


@contextlib.contextmanager
def _accelerator_as_on_cuda():
    """The manager's device probes answer as on a CUDA host (see the module doc); nothing on CUDA."""
    import importlib

    module = importlib.import_module(MODULE)
    if torch.cuda.is_available():
        yield
        return
    names = {
        "get_device_name": lambda: "cuda",
        "is_device_available": lambda: True,
        "get_torch_device": lambda: torch.cuda,
    }
    saved = {name: getattr(module, name) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _seed(seed):
    from megatron.core import tensor_parallel
    from verl.workers.engine.megatron.utils import set_random_seed

    set_random_seed(seed)
    if not torch.cuda.device_count():  # verl seeds the tracker only where it sees an accelerator
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _manager(cfg, model, optimizer, scheduler):
    """verl's MegatronCheckpointManager, built as its Megatron engine builds it."""
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    contents = ["model", "optimizer", "extra"]
    config = {
        "model": {"path": "unused: no Hugging Face weights are saved or loaded"},
        "megatron": {
            "dist_ckpt_optim_fully_reshardable": cfg.optim_format == "fully_reshardable",
            "distrib_optim_fully_reshardable_mem_efficient": False,
        },
    }
    return MegatronCheckpointManager(
        config=OmegaConf.create(config),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents, "async_save": False}),
        model_config=None,
        transformer_config=model.config,
        role="actor",
        model=torch.nn.ModuleList([model]),
        arch="GPTModel",
        hf_config=None,
        param_dtype=torch.bfloat16,
        share_embeddings_and_output_weights=False,
        processing_class=None,
        optimizer=optimizer,
        optimizer_scheduler=scheduler,
        use_distributed_optimizer=cfg.distributed_optimizer,
        use_checkpoint_opt_param_scheduler=True,
        use_dist_checkpointing=True,
    )


def _step_dir(ckpt_dir, step):
    """Where verl's trainer puts the actor's checkpoint of a step."""
    return os.path.join(ckpt_dir, f"global_step_{step}", "actor")


def _load(manager, path):
    """verl's load; the warnings it raised (recorded: a load that reads an older layout says so)."""
    with warnings.catch_warnings(record=True) as caught, quiet():
        warnings.simplefilter("always")
        manager.load_checkpoint(path)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen):
    from megatron.core import parallel_state as mpu

    args = job.parse_args(cfg, ckpt_dir, steps)  # Megatron's arguments build the model, as in job.py
    mpu.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, expert_model_parallel_size=cfg.ep or 1)
    _seed(job.SEED)
    model, optimizer, scheduler = job.build(args, cfg)
    manager = _manager(cfg, model, optimizer, scheduler)
    out = {"coords": job.coords(), "losses": {}}
    if phase == "uninterrupted":
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, 1, steps)
    elif phase == "save":
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, 1, resume_at)
        with quiet():
            manager.save_checkpoint(_step_dir(ckpt_dir, resume_at), global_step=resume_at)
        dist.barrier()
        out["losses"].update(
            job.train_steps(model, optimizer, scheduler, args, cpu_gen, resume_at + 1, steps)
        )  # (job.py)
    else:
        out["load_warnings"] = _load(manager, _step_dir(ckpt_dir, resume_at))
        out["losses"] = job.train_steps(model, optimizer, scheduler, args, cpu_gen, resume_at + 1, steps)
    out["state"] = job.snapshot(model, optimizer, scheduler)
    return out


def run(rank, world_size, cfg, phase, ckpt_dir, steps, resume_at, device="cpu"):
    """One rank of one run, as :func:`..testing.gpt_job.run` (the same phases, the same result), checkpointed
    through verl's ``MegatronCheckpointManager``."""
    assert world_size == cfg.world, f"{cfg.name} runs on {cfg.world} ranks, got {world_size}"
    with job.worker(cfg, device) as cpu_gen, _accelerator_as_on_cuda():
        return _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen)
