"""One rank of a resume-check run that checkpoints through Megatron-Bridge's own functions.

The job trains as :mod:`..testing.gpt_job` does (Megatron's arguments, ``GPTModel`` with local layers and one
expert per EP rank, ``Float16Module``, Megatron's ``DistributedDataParallel``, the distributed
optimizer, the scheduler, the same batches, dropout and router noise), seeded as a Bridge run seeds
(Bridge's ``_set_random_seed``). What differs is the checkpoint: run B saves with
``megatron.bridge.training.checkpointing.save_checkpoint`` and run C loads with its
``load_checkpoint``, both given a real Bridge ``ConfigContainer`` / ``GlobalState`` (Bridge's own
config classes, describing this job: its model sizes and parallelism, the distributed optimizer, the
checkpoint directory and format). Bridge builds the state dict itself (its own RNG entry, rerun
state, the distributed optimizer's sharding type from its ``CheckpointConfig``) and restores it,
``TrainState`` included; the job advances ``TrainState`` every step as Bridge's training loop does,
and its step and consumed samples are compared with the rest.

Stand-ins, besides :mod:`..testing.gpt_job`'s (test and selftest workers only): for ``import megatron.bridge`` on
a host without Transformer Engine, which cannot be installed without CUDA, the stand-in of
:func:`mcore_ckpt_fixes.testing._standins.install_transformer_engine_stand_in_for_bridge` (visible to
``megatron.bridge.peft.lora_layers``' import only; nothing of Transformer Engine runs here).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ..testing import gpt_job as job
from ..testing.bridge_config import cpu_gpt_provider
from ..testing.quiet import quiet

MODULE = "megatron.bridge.training.checkpointing"
# What Bridge's training loop adds to TrainState's FLOP counter per step: any fixed number does
# (the job counts none); an integer that float32 holds exactly, see _bridge_state.
FLOPS_PER_STEP = 1 << 20


def prepare() -> None:
    """In the parent, before any world: let Bridge import here (the Transformer Engine stand-in, where
    TE is not installed) and import it once, so that the forked ranks start warm. Where Bridge is not
    installed nothing is imported; the configuration then says why it is not applicable."""
    from ..testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    with contextlib.suppress(ImportError):
        from ..fixes.rng_under_ep.checks.bridge import prepare as prepare_bridge

        prepare_bridge()


def _model_provider(cfg, args):
    """Bridge's description of the model the job builds (what its run_config.yaml records and its
    load compares: the parallel sizes)."""
    return cpu_gpt_provider(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        tensor_model_parallel_size=cfg.tp,
        num_moe_experts=cfg.ep or None,
        expert_model_parallel_size=cfg.ep or 1,
        moe_grouped_gemm=False,
        moe_router_force_load_balancing=bool(cfg.ep),
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        bf16=True,
        params_dtype=torch.bfloat16,
    )


def _config(cfg, args, ckpt_dir):
    """Bridge's ConfigContainer for this job: its defaults, but for what describes the job."""
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        LoggerConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    return ConfigContainer(
        train=TrainingConfig(
            micro_batch_size=1, global_batch_size=args.global_batch_size, train_iters=args.train_iters
        ),
        model=_model_provider(cfg, args),
        optimizer=OptimizerConfig(
            lr=args.lr,
            min_lr=args.min_lr,
            weight_decay=args.weight_decay,
            clip_grad=args.clip_grad,
            bf16=True,
            use_distributed_optimizer=cfg.distributed_optimizer,
        ),
        scheduler=SchedulerConfig(),
        dataset=None,
        logger=LoggerConfig(),
        tokenizer=TokenizerConfig(),
        rng=RNGConfig(seed=job.SEED),
        checkpoint=CheckpointConfig(
            save=ckpt_dir,
            load=ckpt_dir,
            ckpt_format=cfg.ckpt_format,
            save_interval=1,
            dist_ckpt_optim_fully_reshardable=cfg.optim_format == "fully_reshardable",
        ),
    )


def _bridge_state(state):
    """Bridge's TrainState, as compared: the step and the sample counters say where the data
    resumes. Its FLOP counter Bridge writes as float32 (``train_state_finalize_fn``), so a count
    float32 cannot hold comes back rounded; the job's count is one it holds (FLOPS_PER_STEP)."""
    return {f"bridge:train_state:{k}": v for k, v in state.train_state.state_dict().items()}


def _train(model, optimizer, scheduler, args, cpu_gen, state, first, last):
    losses = {}
    for step in range(first, last + 1):
        losses[step] = job.train_step(model, optimizer, scheduler, args, cpu_gen)
        # What Bridge's training loop counts after every step.
        state.train_state.step += 1
        state.train_state.consumed_train_samples += args.global_batch_size
        state.train_state.floating_point_operations_so_far += FLOPS_PER_STEP
    return losses


def _save(state, model, optimizer, scheduler):
    from megatron.bridge.training.checkpointing import save_checkpoint

    with quiet():  # Bridge prints and logs a great deal per save; none of it is the result
        save_checkpoint(state, [model], optimizer, scheduler, state.train_state.floating_point_operations_so_far)
    dist.barrier()


def _load(state, model, optimizer, scheduler):
    """Bridge's load; the warnings it raised (recorded: a load that reads an older layout says so)."""
    from megatron.bridge.training.checkpointing import load_checkpoint

    with warnings.catch_warnings(record=True) as caught, quiet():
        warnings.simplefilter("always")
        iteration, _ = load_checkpoint(state, [model], optimizer, scheduler)
    return iteration, [f"{w.category.__name__}: {w.message}" for w in caught]


def _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen):
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state as mpu

    from ..fixes.rng_under_ep.checks.bridge import seed_as_bridge

    args = job.parse_args(cfg, ckpt_dir, steps)  # Megatron's arguments build the model, as in job.py
    mpu.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, expert_model_parallel_size=cfg.ep or 1)
    state = GlobalState()
    state.cfg = _config(cfg, args, ckpt_dir)
    seed_as_bridge(state.cfg.rng.seed, state.cfg.rng.data_parallel_random_init)
    model, optimizer, scheduler = job.build(args, cfg)
    out = {"coords": job.coords(), "losses": {}}
    train = (model, optimizer, scheduler, args, cpu_gen, state)
    if phase == "uninterrupted":
        out["losses"] = _train(*train, 1, steps)
    elif phase == "save":
        out["losses"] = _train(*train, 1, resume_at)
        _save(state, model, optimizer, scheduler)
        out["losses"].update(_train(*train, resume_at + 1, steps))  # the run goes on after its save (job.py)
    else:
        iteration, out["load_warnings"] = _load(state, model, optimizer, scheduler)
        assert iteration == resume_at, f"Bridge's load_checkpoint returned step {iteration}, saved {resume_at}"
        out["losses"] = _train(*train, resume_at + 1, steps)
    out["state"] = {**job.snapshot(model, optimizer, scheduler), **_bridge_state(state)}
    return out


def run(rank, world_size, cfg, phase, ckpt_dir, steps, resume_at, device="cpu"):
    """One rank of one run, as :func:`..testing.gpt_job.run` (the same phases, the same result), checkpointed
    through Bridge."""
    assert world_size == cfg.world, f"{cfg.name} runs on {cfg.world} ranks, got {world_size}"
    with job.worker(cfg, device) as cpu_gen:
        return _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen)
