"""Megatron's DDP and distributed optimizer on a one-layer GPT, for round trips of the optimizer's
checkpoint (test and selftest worker processes only).

A one-layer GPT (local spec), ``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam, the
distributed optimizer; on a CPU host without Transformer Engine or Apex Megatron takes torch's Adam,
unless :func:`mcore_ckpt_fixes.testing._fused_adam.optimizer_path` says otherwise), real optimizer
steps on deterministic gradients (filled into DDP's gradient buffer as a reduce would leave them, the
same on every rank, so that no forward pass is needed). ``device="cuda"`` tensors Megatron's optimizer
allocates are made on the CPU (``cuda_to_cpu_mode``) in :func:`world` on a host without CUDA; a world
started with ``world(device="cuda")`` puts the models on the rank's GPU instead (no shims: Megatron's
real CUDA calls), and the results say where they ran (``device``).
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from dataclasses import dataclass

import torch

# device(): where this world's models live; placed(result): the result naming it (see placement).
from .placement import device, on, placed  # noqa: F401

SOURCE_SEED = 1234


@dataclass(frozen=True)
class Shape:
    """The one-layer GPT's size and how DDP lays its gradient buffer out."""

    hidden_size: int = 64
    positions: int = 8  # max_sequence_length: the position embedding's rows
    shared_embedding: bool = False  # the word embedding marked as a tied one on a pipeline stage
    pad_buckets_for_high_nccl_busbw: bool = False
    # Parameters kept out of the dense all-reduce, as Megatron marks expert weights under EP
    # (``allreduce=False``): DDP gives them the expert buffers, the optimizer an expert optimizer.
    expert_params: tuple = ()
    vocab_size: int = 64  # the untied output layer's rows (and the word embedding's)
    frozen: tuple = ()  # parameters that take no gradient (requires_grad False): not in any buffer


def prepare() -> None:
    """Run in the parent before any world starts: every forked world starts warm (and its first
    save's writer queue is forked, see testing/worker.py)."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401


def values(seed, *parts, shape):
    g = torch.Generator().manual_seed(zlib.crc32("/".join(str(p) for p in (seed,) + parts).encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def build_model(seed, bf16=True, bucket_size=None, shape=None):
    """A one-layer GPT under Megatron's DDP for the distributed optimizer, parameters drawn from
    ``seed`` (the same on both ranks). ``shape``: a :class:`Shape` (default: hidden 64, 8 positions,
    buckets as Megatron pads them by default)."""
    shape = shape or Shape()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=1,
        hidden_size=shape.hidden_size,
        num_attention_heads=2,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=shape.vocab_size, max_sequence_length=shape.positions)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(values(seed, "param", name, shape=p.shape))
            if name in shape.expert_params:
                p.allreduce = False
            if name in shape.frozen:
                p.requires_grad_(False)
    gpt.to(device())
    if shape.shared_embedding:
        # What Megatron marks on the first pipeline stage's word embedding when it is tied to the
        # last stage's output layer (LanguageModule.setup_embeddings_and_output_layer, PP > 1): DDP
        # gives it a bucket of its own, closing the bucket before it at the embedding's aligned start.
        # The gradient buffer's layout reads nothing else of the pipeline.
        gpt.embedding.word_embeddings.weight.shared_embedding = True
    # Megatron builds several buckets only with overlap_grad_reduce (else one bucket, whatever the size).
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
        overlap_grad_reduce=bucket_size is not None,
        # Megatron-LM's --ddp-pad-buckets-for-high-nccl-busbw: each bucket padded to 65536 elements.
        **({"pad_buckets_for_high_nccl_busbw": True} if shape.pad_buckets_for_high_nccl_busbw else {}),
    )
    # Float16Module: every parameter in bf16, as Megatron's training wraps a bf16 model (torch's
    # LayerNorm, the fallback without Apex, would otherwise keep fp32 parameters beside bf16 ones).
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt) if bf16 else gpt)
    # A CUDA world must not quietly test CPU tensors.
    elsewhere = sorted(n for n, p in model.named_parameters() if p.device.type != device().type)
    assert not elsewhere, f"parameters not on {device()}: {elsewhere}"
    return model


def optimizer_config(bf16=True, decoupled_lr=None, **extra):
    """Adam with the distributed optimizer; ``extra``: more OptimizerConfig fields (or others than
    these: ``lr``, ``min_lr``)."""
    from megatron.core.optimizer import OptimizerConfig

    # bf16 with fp32 main parameters, as models train: the main-parameter shards are the
    # optimizer's own tensors (with fp32 model parameters they would be views of the model's).
    fields = dict(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        use_distributed_optimizer=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        # The embedding and output layer's own learning rate (Megatron-LM's --decoupled-lr).
        **({} if decoupled_lr is None else {"decoupled_lr": decoupled_lr, "min_lr": 1e-3}),
    )
    return OptimizerConfig(**{**fields, **extra})


def build(seed, bf16=True, bucket_size=None, decoupled_lr=None, shape=None, lrs=None):
    """Model (DDP) and distributed optimizer with parameters drawn from ``seed`` (the same on both
    ranks); ``lrs``: the optimizer's ``lr`` / ``min_lr`` (Megatron-LM's --lr, --min-lr) if not the default."""
    from megatron.core.optimizer import get_megatron_optimizer

    model = build_model(seed, bf16, bucket_size, shape)
    return model, get_megatron_optimizer(optimizer_config(bf16, decoupled_lr, **(lrs or {})), [model])


def step(model, opt, index):
    """One optimizer step on gradients drawn for step ``index`` (the reduced gradient every rank holds)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    for name, p in model.module.named_parameters():
        if p.requires_grad:  # a frozen parameter has no gradient
            p.main_grad.copy_(values(SOURCE_SEED, "grad", index, name, shape=p.shape))
    ok, _, _ = opt.step()
    assert ok, "the optimizer skipped a step"


def sharding_type(preferred):
    """``preferred`` (``dp_reshardable``, ``fully_reshardable``) where this release saves it, else
    ``fully_sharded_model_space``: before 0.15 the distributed optimizer has neither (both came with
    ``checkpoint_fully_reshardable_formats``), and model space is the reshardable format Megatron-LM
    saved by default there."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if hasattr(DistributedOptimizer, "checkpoint_fully_reshardable_formats"):
        return preferred
    return "fully_sharded_model_space"


def request(model, opt, fmt, is_loading, **metadata):
    """A ``dist_checkpointing`` request of the model and the optimizer in sharding type ``fmt``;
    ``metadata``: more of what megatron.training puts in the optimizer's metadata (0.13 on)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    model_sd = model.module.sharded_state_dict()
    from ..engine.patching import original

    # The release's own signature, not that of a fix's layer in its place.
    if "metadata" in inspect.signature(original(DistributedOptimizer, "sharded_state_dict")).parameters:
        kwargs = {"metadata": {"distrib_optim_sharding_type": fmt, **metadata}}
    else:  # 0.12: the sharding type is an argument of its own
        kwargs = {"sharding_type": fmt}
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)}


def save_request(state, path, *args):
    """``dist_checkpointing.save(state, path, *args)`` into ``path``, which rank 0 makes first (every
    rank waits for it: a save needs the folder on every rank)."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path, *args)


def distributed(opt):
    """The DistributedOptimizers behind what ``get_megatron_optimizer`` returned (a ChainedOptimizer
    from some releases on, even for one)."""
    return getattr(opt, "chained_optimizers", None) or [opt]


def local_state(model, opt):
    """This rank's main-parameter shards and Adam state per parameter, and the model parameters."""
    out = {}
    for name, p in model.module.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        for d in distributed(opt):
            if p not in d.model_param_group_index_map:
                continue
            gi, go = d.model_param_group_index_map[p]
            main = d.optimizer.param_groups[gi]["params"][go]
            out[f"main/{name}"] = main.detach().clone()
            for k, v in d.optimizer.state[main].items():
                # Not the step (checked on its own), nor a non-tensor: before 0.17 a dp_reshardable
                # load hands the hybrid optimizer the bucket's ``padding`` flag too.
                if k != "step" and isinstance(v, torch.Tensor):
                    out[f"{k}/{name}"] = v.detach().clone()
    return out


@contextlib.contextmanager
def world(device="cpu", **parallel):
    """Megatron's process groups (``parallel``: initialize_model_parallel's sizes; none: one
    data-parallel group of every rank), the models on ``device`` ("cpu" or "cuda") and, on a CPU
    host, Megatron's CUDA calls on the CPU; the groups are destroyed after, whatever happened."""
    from megatron.core import parallel_state as mpu

    from ._cpu_shims import cuda_to_cpu_mode

    with on(device):
        mpu.initialize_model_parallel(**parallel)
        try:
            with cuda_to_cpu_mode() if not torch.cuda.is_available() else contextlib.nullcontext():
                yield
        finally:
            with contextlib.suppress(Exception):
                mpu.destroy_model_parallel()


def full_state(model, opt):
    """Every parameter's whole fp32 main value and Adam moments, in the parameter's shape, the same
    on every rank (each rank's shard put in place and summed over the data-parallel group): a view
    that does not depend on how the gradient buffer is cut into buckets and shards."""
    import torch.distributed as dist

    out = {}
    for name, p in model.module.named_parameters():
        for d in distributed(opt):
            if p not in d.model_param_group_index_map:
                continue
            gi, go = d.model_param_group_index_map[p]
            main = d.optimizer.param_groups[gi]["params"][go]
            local = {"main": main, **{k: v for k, v in d.optimizer.state[main].items() if k != "step"}}
            span = d._get_model_param_range_map(p)["param"]
            for kind, value in local.items():
                whole = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                whole[span.start : span.end] = value.detach().float().view(-1)
                out[f"{kind}/{name}"] = whole
        for kind in ("main", "exp_avg", "exp_avg_sq"):
            out.setdefault(f"{kind}/{name}", torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
    for key in sorted(out):
        dist.all_reduce(out[key])
    return out


def run_cases(run_case, names, ckpt_dir, patched, device="cpu"):
    """Several cases of a fix's round trips in one world on ``device``: ``{case: run_case(case,
    ckpt_dir, patched, cache)}``, the cases sharing the source saves ``run_case`` keeps in ``cache``."""
    cache, out = {}, {}
    with world(device):
        for name in names:
            out[name] = placed(run_case(name, ckpt_dir, patched, cache))
    return out


def one_case(run_case, name):
    """A world entry point (``selftest``'s scenario) that runs case ``name`` alone; named and placed
    in ``run_case``'s module, so that ``"module:name"`` finds it and spawned ranks unpickle it."""

    def scenario(rank, world_size, ckpt_dir, patched, device="cpu"):
        with world(device):
            return placed(run_case(name, ckpt_dir, patched))

    scenario.__name__ = scenario.__qualname__ = name
    scenario.__module__ = run_case.__module__
    return scenario
