"""One rank of a resume-check run: a small GPT trained with Megatron's own parts.

Megatron's arguments (``parse_args`` / ``validate_args`` / ``set_global_variables``, no
tokenizer), ``GPTModel`` (local layers, tied embeddings as ``pretrain_gpt`` ties them; MoE where the
configuration has experts: one expert per EP rank, two under EP=1, sequence parallel under TP > 1), ``Float16Module`` (bf16), Megatron's ``DistributedDataParallel``,
``get_megatron_optimizer`` (the distributed optimizer where the configuration says so),
``get_optimizer_param_scheduler``, and ``megatron.training.checkpointing``'s ``save_checkpoint`` /
``load_checkpoint``: the same calls a training run makes between steps. A configuration with pipeline
stages is built and stepped by :mod:`.pipeline_job` (Megatron's ``get_model`` and schedule).

Every RNG stream Megatron checkpoints is consumed every step, each into the loss:

* Python ``random`` picks how far the sample is rolled, NumPy draws the tokens, the CPU generator
  which tokens are masked;
* torch's default generator draws the hidden dropout (the CPU stand-in below makes it the
  generator Megatron's RNG tracker swaps, as a GPU's default CUDA generator is);
* the tracker's model-parallel stream draws the attention dropout, its expert-parallel stream the
  MoE router's random logits (``moe_router_force_load_balancing``), and every tracker stream gives
  one more draw that scales the loss (so a stream no layer draws from, e.g. the data-parallel one,
  counts too).

CPU stand-ins (worker processes only): torch's default generator plays the CUDA default generator
and a second one the CPU generator (:mod:`._rng_standin`), so a tracker fork really changes what
dropout and ``normal_()`` draw; ``device="cuda"`` tensors are made on the CPU (``cuda_to_cpu_mode``); Apex's FusedAdam is
stood in for where the configuration asks for it (``fused_adam``); under sequence parallel torch's
norm takes Apex's ``FusedLayerNorm``'s place (:func:`sequence_parallel_torch_norms`). On CUDA none of
them is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import random
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

SEED = 1234
VOCAB, SEQ = 32, 8


def training_checkpointing():
    """``megatron.training.checkpointing`` where the release ships it (0.17+ wheels, checkouts), else None."""
    try:
        from megatron.training import checkpointing
    except ImportError:
        return None
    return checkpointing


def run_options(ckpt_dir, steps) -> list:
    """What each run adds to a user's own job (``Config.megatron_argv``): its checkpoint directory
    (saved every step it is asked to save) and its length."""
    return ["--save", ckpt_dir, "--load", ckpt_dir, "--save-interval", "1", "--train-iters", str(steps)]


def _argv(cfg, ckpt_dir, steps, resume_args=()):
    if cfg.megatron_argv:  # a user's own job: its arguments, this run's length and directory
        return ["mcore-ckpt-fixes-resume", *cfg.megatron_argv, *run_options(ckpt_dir, steps), *resume_args]
    argv = [
        "mcore-ckpt-fixes-resume",
        "--num-layers",
        str(cfg.num_layers),
        "--hidden-size",
        str(cfg.hidden),
        "--num-attention-heads",
        "2",
        "--seq-length",
        str(SEQ),
        "--max-position-embeddings",
        str(SEQ),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(cfg.global_batch_size),
        "--tensor-model-parallel-size",
        str(cfg.tp),
        "--pipeline-model-parallel-size",
        str(cfg.pp),
        "--use-cpu-initialization",
        *(["--bf16"] if cfg.bf16 else []),
        "--ckpt-format",
        cfg.ckpt_format,
        "--transformer-impl",
        "local",
        "--no-persist-layer-norm",
        "--no-gradient-accumulation-fusion",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-rope-fusion",
        "--attention-dropout",
        "0.1",
        "--hidden-dropout",
        "0.1",
        "--save",
        ckpt_dir,
        "--load",
        ckpt_dir,
        "--save-interval",
        "1",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--lr",
        "0.01",
        "--min-lr",
        "0.001",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "1",
        "--weight-decay",
        "0.01",
        "--clip-grad",
        "1.0",
        "--train-iters",
        str(steps),
        "--seed",
        str(SEED),
    ]
    if cfg.vpp:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(cfg.num_layers // (cfg.pp * cfg.vpp))]
    if cfg.ep:
        argv += _moe_argv(cfg)
    if cfg.distributed_optimizer:
        argv.append("--use-distributed-optimizer")
    if cfg.optim_format == "fully_reshardable":
        argv.append("--dist-ckpt-optim-fully-reshardable")
    if cfg.decoupled_lr is not None:
        argv += ["--decoupled-lr", str(cfg.decoupled_lr)]
    return argv + list(cfg.extra_args) + list(resume_args)


def _moe_argv(cfg):
    """MoE arguments: experts, expert parallelism and their layout."""
    argv = [
        "--num-experts",
        str(max(cfg.ep, 2)),  # the router's default top-2 needs two experts, also under EP=1
        "--expert-model-parallel-size",
        str(cfg.ep),
        "--moe-router-force-load-balancing",
        "--moe-token-dispatcher-type",
        "allgather",
    ]
    if cfg.etp:
        argv += ["--expert-tensor-parallel-size", str(cfg.etp)]
    if cfg.tp > 1:
        # MoE layers refuse to train under TP without sequence parallel. Without biases: with
        # expert TP 1 an expert's output is its reduce-scatter's input returned as a view, and
        # SequentialMLP adds the bias to it in place, which autograd rejects on any device.
        argv += ["--sequence-parallel", "--disable-bias-linear"]
    return argv


def parse_args(cfg, ckpt_dir, steps, resume_args=()):
    from megatron.training import arguments, global_vars

    saved_argv, sys.argv = sys.argv, _argv(cfg, ckpt_dir, steps, resume_args)
    if torch.cuda.is_available() and "--use-megatron-fsdp" not in sys.argv:
        # As Megatron's launch scripts set it: on a GPU, validate_args refuses TP or CP > 1 without
        # it (the kernels' order on one hardware queue); Megatron-FSDP wants it unset.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    saved_arch = getattr(arguments, "get_device_arch_version", None)
    if saved_arch is not None and not torch.cuda.is_available():
        # validate_args asks the GPU's architecture under TP > 1 (for CUDA_DEVICE_MAX_CONNECTIONS);
        # a CPU host has none: answer as a GPU without that requirement would.
        arguments.get_device_arch_version = lambda: 10
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            args = arguments.parse_args()
            arguments.validate_args(args, {})
            global_vars.set_global_variables(args, build_tokenizer=False)
    finally:
        sys.argv = saved_argv
        if saved_arch is not None:
            arguments.get_device_arch_version = saved_arch
    if cfg.strictness:
        args.dist_ckpt_strictness = cfg.strictness
    if cfg.rerun_mode:
        args.rerun_mode = cfg.rerun_mode
    # Megatron-LM main saves tokenizer files beside a torch_dist checkpoint; this job has none.
    if getattr(args, "save_tokenizer_assets", False):
        args.save_tokenizer_assets = False
    return args


def rerun_machine(args):
    """The process's rerun state machine as ``initialize_megatron`` sets it up (mode from the
    arguments; its state save and restore are the RNG tracker's states)."""
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

    def state_restore_func(state_dict):
        if state_dict["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(state_dict["rng_tracker_states"])

    initialize_rerun_state_machine(
        state_save_func=lambda: {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()},
        state_restore_func=state_restore_func,
        mode=RerunMode(args.rerun_mode),
    )


def seed(args):
    """Megatron's seeding (``_set_random_seed``); on CPU also the tracker, which it seeds only
    when it sees a GPU."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training.initialize import _set_random_seed

    _set_random_seed(args.seed, args.data_parallel_random_init)
    if torch.cuda.device_count() == 0:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed + 100 * mpu.get_pipeline_model_parallel_rank())


def optimizer_config(args):
    """Megatron's ``OptimizerConfig`` from the run's arguments (every field they name)."""
    from megatron.core.optimizer import OptimizerConfig

    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    return OptimizerConfig(**{k: v for k, v in vars(args).items() if k in fields})


def build(args, cfg, on_model=None):
    """Model, DDP wrapper, optimizer and scheduler, as ``setup_model_and_optimizer`` builds them;
    ``on_model(model)``: called with the wrapped model before the optimizer is built over it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.training import arguments
    from megatron.training.training import get_optimizer_param_scheduler

    config = arguments.core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(num_experts=cfg.ep or None, moe_grouped_gemm=False)
    gpt = GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        # Tied, as pretrain_gpt ties them unless --untie-embeddings-and-output-weights.
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=cfg.ddp_bucket_size,
        overlap_grad_reduce=cfg.ddp_bucket_size is not None,  # Megatron cuts buckets only then
        # --ddp-pad-buckets-for-high-nccl-busbw, as get_model passes it on
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
    )
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt) if cfg.bf16 else gpt)
    if on_model is not None:
        on_model(model)
    optimizer = get_megatron_optimizer(optimizer_config(args), [model])
    if cfg.optimizer_requests != "megatron":
        _requests_as_trainers_build_them(optimizer, keep_metadata=cfg.optimizer_requests == "without-is-loading")
    return model, optimizer, get_optimizer_param_scheduler(optimizer)


def _requests_as_trainers_build_them(optimizer, keep_metadata):
    """Each distributed optimizer's ``sharded_state_dict`` is called as third-party trainers call it,
    whatever ``save_checkpoint`` / ``load_checkpoint`` pass: never with ``is_loading``, and with the
    ``metadata`` they pass (``keep_metadata``) or with none."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:

        def sharded_state_dict(model_sharded_state_dict, *args, _opt=opt, metadata=None, **kwargs):
            kept = {"metadata": metadata} if keep_metadata else {}
            return type(_opt).sharded_state_dict(_opt, model_sharded_state_dict, **kept)

        opt.sharded_state_dict = sharded_state_dict


def rank_device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def batch(cpu_gen):
    """This step's sample: NumPy draws the tokens, Python's ``random`` how far they are rolled, the
    CPU generator which of them are replaced by token 0 (as a loader's masking would)."""
    tokens = np.random.randint(0, VOCAB, size=(1, SEQ + 1))
    tokens = np.roll(tokens, random.randrange(SEQ + 1), axis=1)
    tokens = torch.from_numpy(tokens)
    tokens = tokens.masked_fill(torch.rand(tokens.shape, generator=cpu_gen) < 0.2, 0)
    position_ids = torch.arange(SEQ).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True: masked
    return tokens[:, :-1].contiguous(), position_ids, mask, tokens[:, 1:].contiguous()


def loss_scale():
    """One draw from every tracker stream (the data-parallel one included, which no layer draws
    from), folded into the loss."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    scale = torch.ones((), device=rank_device())
    for name in sorted(tracker.get_states()):
        with tracker.fork(name):  # swaps the CUDA generator (on a CPU host: its stand-in)
            scale = scale + 0.01 * torch.rand((), device=rank_device())
    return scale


def train_step(model, optimizer, scheduler, args, cpu_gen):
    from megatron.core.distributed import finalize_model_grads

    model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens, position_ids, mask, labels = (t.to(rank_device()) for t in batch(cpu_gen))
    per_token = model(tokens, position_ids, mask, labels=labels)
    loss = per_token.float().mean() * loss_scale()
    loss.backward()
    finalize_model_grads([model])
    ok, _, _ = optimizer.step()
    assert ok, "the optimizer skipped a step (overflow): the run would not be comparable"
    scheduler.step(increment=args.global_batch_size)
    return float(loss.detach())


# -- what a resumed run must have exactly as the uninterrupted one -------------------------------------


def _inner_optimizers(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _scalar(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, (int, float, bool, str, tuple, type(None))):
        return value
    return repr(value)


def snapshot(model, optimizer, scheduler):
    """This rank's whole training state, by name: parameters, every optimizer state tensor and
    scalar (the torch optimizers' groups and per-parameter state, their parameters being the
    distributed optimizer's fp32 main shards; not the step of a group empty on this rank), the
    scheduler, and every RNG stream."""
    from megatron.core import tensor_parallel

    models = chunks(model)
    state = {}
    for i, chunk in enumerate(models):
        where = f"chunk{i}." if len(models) > 1 else ""  # virtual pipeline stages: one per chunk
        state.update({f"param:{where}{n}": p.detach().clone().cpu() for n, p in chunk.module.named_parameters()})
    for i, inner in enumerate(_inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for key, value in sorted(group.items()):
                # A group the distributed optimizer left empty on this rank updates nothing: its
                # step is Apex's and TE's to leave alone (they count only groups with parameters)
                # and Megatron's to align when it saves, so a resumed run's differs, unobservably.
                if key != "params" and not (key == "step" and not group["params"]):
                    state[f"optim{i}:group{g}:{key}"] = _scalar(value)
            for j, p in enumerate(group["params"]):
                state[f"optim{i}:group{g}:main{j}"] = p.detach().clone().cpu()
                for key, value in sorted(inner.state.get(p, {}).items()):
                    state[f"optim{i}:group{g}:state{j}:{key}"] = _scalar(value)
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", None) or [optimizer]):
        scaler = getattr(opt, "grad_scaler", None)  # fp16's loss scale and its trackers
        if scaler is not None:
            for key, value in sorted(scaler.state_dict().items()):
                state[f"scaler{i}:{key}"] = _scalar(value)
    for key, value in sorted(scheduler.state_dict().items()):
        state[f"scheduler:{key}"] = _scalar(value)
    state["rng:python"] = random.getstate()
    state["rng:numpy"] = tuple(np.random.get_state())
    state["rng:torch"] = torch.get_rng_state().clone()
    if torch.cuda.is_available():
        state["rng:cuda"] = torch.cuda.get_rng_state().clone()
    for name, value in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        state[f"rng:tracker:{name}"] = (value.get_state() if isinstance(value, torch.Generator) else value).clone()
    return state


def snapshot_tensors(model, optimizer, scheduler, model_only=False) -> dict:
    """:func:`snapshot` as tensors alone (numbers as float64 tensors, the rest left out), for a
    round trip's comparison; the model's parameters alone if ``model_only``."""
    found = {}
    for name, value in snapshot(model, optimizer, scheduler).items():
        if model_only and not name.startswith("param:"):
            continue
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, (bool, int, float)):
            found[name] = torch.tensor(value, dtype=torch.float64)
    return found


def trained_and_saved(save_checkpoint, cfg, save_dir, steps, cpu_gen, train_iters=2):
    """The job of ``cfg`` (arguments parsed for ``train_iters`` iterations, saving to and loading from
    ``save_dir``) built, trained ``steps`` steps and saved at iteration ``steps`` by
    ``save_checkpoint`` (megatron.training's), every rank past the save: (args, model, optimizer,
    scheduler)."""
    from megatron.core import parallel_state as mpu

    args = parse_args(cfg, save_dir, train_iters)
    mpu.initialize_model_parallel()
    seed(args)
    model, optimizer, scheduler = build(args, cfg)
    for _ in range(steps):
        train_step(model, optimizer, scheduler, args, cpu_gen)
    save_checkpoint(steps, [model], optimizer, scheduler, 0)
    dist.barrier()
    return args, model, optimizer, scheduler


def built_anew(cfg, save_dir, options=()):
    """The job of ``cfg`` with ``options`` built as a resumed job's new process builds it, its
    arguments parsed again: (args, model, optimizer, scheduler)."""
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    args = parse_args(cfg, save_dir, 2, options)
    seed(args)
    return (args, *build(args, cfg))


def prepare_training() -> None:
    """A fix's ``prepare`` for round trips through megatron.training: in the parent of a forked
    world, the modules every rank uses, imported once."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.training.training  # noqa: F401


def coords():
    from megatron.core import parallel_state as mpu

    return {
        "rank": dist.get_rank(),
        "tp": mpu.get_tensor_model_parallel_rank(),
        "pp": mpu.get_pipeline_model_parallel_rank(),
        "ep": mpu.get_expert_model_parallel_rank(),
        "dp": mpu.get_data_parallel_rank(),
    }


def train_steps(model, optimizer, scheduler, args, feed, first, last):
    """Steps ``first`` to ``last``: losses by step. ``feed`` is what each step draws its samples
    from: the CPU generator, or for the pipeline job's chunks (a list) their data iterators."""
    if isinstance(model, list):
        from .pipeline_job import train_step as step
    else:
        step = train_step
    return {i: step(model, optimizer, scheduler, args, feed) for i in range(first, last + 1)}


def start(cfg, args, cpu_gen):
    """What ``initialize_megatron`` and ``setup_model_and_optimizer`` do for this job once the
    parallel state is up: the rerun state machine, the seeds, then the model, optimizer and
    scheduler; with them what the steps draw samples from (:func:`train_steps`). A pipeline
    configuration is built and trained by :mod:`.pipeline_job` (inside the rerun state machine,
    as Megatron's schedule needs). (``--async-save`` without a persistent worker ``validate_args``
    turns off; with one, the worker needs a GPU or nvidia-resiliency-ext, and the job does not
    start it.)"""
    if cfg.rerun_mode or cfg.pp > 1 or cfg.megatron_argv:
        rerun_machine(args)
    seed(args)
    if cfg.pp > 1 or cfg.megatron_argv:
        from . import pipeline_job

        model, optimizer, scheduler = pipeline_job.build(args, cfg)
        return model, optimizer, scheduler, pipeline_job.data_iterators(model, cpu_gen)
    return (*build(args, cfg), cpu_gen)


def initialize_parallel(cfg, args):
    """Megatron's parallel state for the job's layout, as ``initialize_megatron`` sets it up."""
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen):
    from megatron.training.checkpointing import save_checkpoint

    args = parse_args(cfg, ckpt_dir, steps)
    initialize_parallel(cfg, args)
    if phase == "resume":
        if cfg.resume_args:
            return _resume_each_way(cfg, ckpt_dir, steps, resume_at, cpu_gen)
        return _resume(cfg, args, steps, resume_at, cpu_gen)
    if phase == "reload":
        return _reload(cfg, args, steps, resume_at, cpu_gen)
    if phase == "reference":
        return _save_with_reference(cfg, args, resume_at, cpu_gen)
    if phase == "interrupted":
        return _save_then_die_saving(cfg, args, resume_at, cpu_gen)
    model, optimizer, scheduler, feed = start(cfg, args, cpu_gen)
    out = {"coords": coords(), "losses": {}}
    if phase == "uninterrupted":
        out["losses"] = train_steps(model, optimizer, scheduler, args, feed, 1, steps)
    else:
        out["losses"] = train_steps(model, optimizer, scheduler, args, feed, 1, resume_at)
        save_checkpoint(resume_at, chunks(model), optimizer, scheduler, 0)
        dist.barrier()
        # A training run goes on after its save: with the fixes on this is the run that never
        # resumes, compared bit for bit with the release's own uninterrupted run (check.py).
        out["losses"].update(train_steps(model, optimizer, scheduler, args, feed, resume_at + 1, steps))
    out["state"] = snapshot(model, optimizer, scheduler)
    return out


def _resume(cfg, args, steps, resume_at, cpu_gen):
    """Run C: a newly built job loads the checkpoint and trains the remaining steps."""
    from megatron.training.checkpointing import load_checkpoint

    model, optimizer, scheduler, feed = start(cfg, args, cpu_gen)
    out = {"coords": coords()}
    # Recorded, not only shown: a load that reads an older layout must say so (a warning), and
    # the check across releases reports what each load said.
    iteration, out["load_warnings"] = load_recording_warnings(load_checkpoint, model, optimizer, scheduler)
    out["iteration"] = iteration  # --finetune resumes at 0 (as-release configurations compare it)
    if cfg.expect == "exact":
        assert iteration == resume_at, f"load_checkpoint returned iteration {iteration}, saved {resume_at}"
    out["losses"] = train_steps(model, optimizer, scheduler, args, feed, resume_at + 1, steps)
    out["state"] = snapshot(model, optimizer, scheduler)
    return out


# The resume across layouts (mcore_ckpt_fixes.resume.layouts) compares two saves of the same state
# in model space (the optimizer saved fully_reshardable, whatever format the run uses): the one the
# saving layout writes beside its checkpoint, and the one the loading layout writes of what it loaded.
def reference(ckpt_dir) -> str:
    """Where the ``reference`` phase writes its model-space save beside the checkpoint ``ckpt_dir``."""
    return ckpt_dir.rstrip("/") + ".reference"


def resaved(ckpt_dir) -> str:
    """Where the ``reload`` phase writes, in model space, what it loaded from ``ckpt_dir``."""
    return ckpt_dir.rstrip("/") + ".resaved"


def _save_in_model_space(args, iteration, model, optimizer, scheduler, save_dir):
    from megatron.training.checkpointing import save_checkpoint

    kept = args.save, args.dist_ckpt_optim_fully_reshardable
    args.save, args.dist_ckpt_optim_fully_reshardable = save_dir, True
    try:
        save_checkpoint(iteration, chunks(model), optimizer, scheduler, 0)
    finally:
        args.save, args.dist_ckpt_optim_fully_reshardable = kept
    dist.barrier()


def _save_with_reference(cfg, args, resume_at, cpu_gen):
    """Train ``resume_at`` steps, save the checkpoint as the run does, and beside it in model space."""
    from megatron.training.checkpointing import save_checkpoint

    model, optimizer, scheduler, feed = start(cfg, args, cpu_gen)
    out = {"coords": coords(), "losses": train_steps(model, optimizer, scheduler, args, feed, 1, resume_at)}
    save_checkpoint(resume_at, chunks(model), optimizer, scheduler, 0)
    dist.barrier()
    _save_in_model_space(args, resume_at, model, optimizer, scheduler, reference(args.save))
    return out


def _save_then_die_saving(cfg, args, resume_at, cpu_gen):
    """Train ``resume_at`` steps and save; train one more and save again, the last rank killed in
    that save after writing its own shards (:mod:`._interrupt`): the job dies there."""
    from megatron.training.checkpointing import save_checkpoint

    from ._interrupt import dies_after_writing

    model, optimizer, scheduler, feed = start(cfg, args, cpu_gen)
    train_steps(model, optimizer, scheduler, args, feed, 1, resume_at)
    save_checkpoint(resume_at, chunks(model), optimizer, scheduler, 0)
    dist.barrier()
    train_steps(model, optimizer, scheduler, args, feed, resume_at + 1, resume_at + 1)
    with dies_after_writing(cfg.world - 1):
        save_checkpoint(resume_at + 1, chunks(model), optimizer, scheduler, 0)
    dist.barrier()
    raise AssertionError("the save with a killed rank completed")


def _reload(cfg, args, steps, resume_at, cpu_gen):
    """A job on another layout loads the checkpoint, saves what it loaded at once in model space
    (before any step) and trains the remaining steps."""
    from megatron.training.checkpointing import load_checkpoint

    model, optimizer, scheduler, feed = start(cfg, args, cpu_gen)
    out = {"coords": coords()}
    out["iteration"], out["load_warnings"] = load_recording_warnings(load_checkpoint, model, optimizer, scheduler)
    _save_in_model_space(args, out["iteration"], model, optimizer, scheduler, resaved(args.load))
    out["losses"] = train_steps(model, optimizer, scheduler, args, feed, resume_at + 1, steps)
    return out


def _resume_each_way(cfg, ckpt_dir, steps, resume_at, cpu_gen):
    """Run C once per ``cfg.resume_args``: each way builds the job anew as a new process would
    (Megatron's arguments parsed again with its options, the rerun state machine and seeds set up
    again, a new model, optimizer and scheduler), loads and trains on. A way that raises is recorded
    as its error (its last line, as a failed world reports it) and the next one runs."""
    import traceback

    from megatron.core.rerun_state_machine import destroy_rerun_state_machine
    from megatron.training import global_vars

    ways = []
    for extra in cfg.resume_args:
        global_vars.unset_global_variables()
        destroy_rerun_state_machine()
        try:
            ways.append(_resume(cfg, parse_args(cfg, ckpt_dir, steps, extra), steps, resume_at, cpu_gen))
        except Exception as exc:
            last = " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())  # one line
            ways.append({"coords": coords(), "error": last, "detail": traceback.format_exc()})
    return {"ways": ways}


def load_recording_warnings(load_checkpoint, model, optimizer, scheduler):
    """(the iteration :func:`load` returned, every warning it raised as one line each)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iteration, _ = load(load_checkpoint, model, optimizer, scheduler)
    return iteration, [f"{w.category.__name__}: {w.message}" for w in caught]


def chunks(model) -> list:
    """The model chunks of a job: its one DDP-wrapped model, or the pipeline job's list of them."""
    return model if isinstance(model, list) else [model]


def load(load_checkpoint, model, optimizer, scheduler):
    """``load_checkpoint``; where it gives up by printing why and calling ``sys.exit()`` (a legacy
    file it cannot read), an error carrying what it printed, not a bare ``SystemExit``."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            return load_checkpoint(chunks(model), optimizer, scheduler)
    except SystemExit:
        said = [line for line in printed.getvalue().splitlines() if line.strip()]
        raise RuntimeError(f"load_checkpoint exited: {' / '.join(said[-2:])}") from None


@contextlib.contextmanager
def sequence_parallel_torch_norms():
    """Apex's ``FusedLayerNorm`` stood in by torch's under sequence parallel (Apex does not install
    without CUDA; Megatron's torch norm refuses sequence parallel). What Apex's adds for it is a
    mark: the norm's parameters get ``sequence_parallel = True``, so that ``finalize_model_grads``
    all-reduces their gradients across the TP group (each TP rank saw its own part of the sequence)."""
    import dataclasses as dc

    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__dict__["__new__"]

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        norm = original(cls, dc.replace(config, sequence_parallel=False), hidden_size, eps, **kwargs)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = __new__
    try:
        yield
    finally:
        torch_norm.WrappedTorchNorm.__new__ = original


def runs_on_gpu(device) -> bool:
    """Whether a job asked to run on ``device`` runs on the rank's GPU: a ``cuda`` run, or any run
    on a host with CUDA (only a CPU host runs on the CPU, with the CUDA stand-ins)."""
    return device != "cpu" or torch.cuda.is_available()


@contextlib.contextmanager
def worker(cfg, device):
    """A rank's surroundings for training ``cfg``: the RNG and (on a CPU host) CUDA stand-ins and
    the FusedAdam path; yields the CPU generator. Model-parallel state is destroyed on the way out."""
    from ._cpu_shims import cpu_streams, cuda_to_cpu_mode
    from ._fused_adam import job_path
    from ._rng_standin import TrainingRngStandIn
    from .placement import deterministic_kernels

    torch.set_num_threads(1)  # the same kernels in every run, whatever the host's core count
    on_cpu = not runs_on_gpu(device)
    with contextlib.ExitStack() as stack:
        rng = stack.enter_context(TrainingRngStandIn())
        stack.enter_context(deterministic_kernels(on_gpu=not on_cpu))  # runs compared bit for bit
        if on_cpu:
            stack.enter_context(cuda_to_cpu_mode())
            stack.enter_context(cpu_streams())
            if cfg.sequence_parallel:
                stack.enter_context(sequence_parallel_torch_norms())
        stack.enter_context(job_path(cfg.fused_adam, on_cpu))
        try:
            yield rng.cpu_generator()
        finally:
            from megatron.core import parallel_state as mpu

            from megatron.core.rerun_state_machine import destroy_rerun_state_machine

            with contextlib.suppress(Exception):
                mpu.destroy_model_parallel()
            with contextlib.suppress(Exception):
                destroy_rerun_state_machine()


def run(rank, world_size, cfg, phase, ckpt_dir, steps, resume_at, device="cpu"):
    """One rank of one run (``phase``: ``uninterrupted``, ``save``, ``resume``, ``interrupted`` (the
    second save dies halfway), or for the resume across layouts ``reference`` and ``reload``); a world entry point
    for :func:`mcore_ckpt_fixes.testing.launcher.run_world`. Returns this rank's losses by step and
    its final state (:func:`snapshot`); ``save`` saves after ``resume_at`` steps and trains on to
    ``steps``, as a training run does."""
    from ._fused_adam import path_in_use

    assert world_size == cfg.world, f"{cfg.name} runs on {cfg.world} ranks, got {world_size}"
    with worker(cfg, device) as cpu_gen:
        out = _run_phase(cfg, phase, ckpt_dir, steps, resume_at, cpu_gen)
        out["optimizer"] = path_in_use()  # which Adam this run took (a GPU record says it)
        return out
