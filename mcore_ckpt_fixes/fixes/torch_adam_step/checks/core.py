"""torch-adam-step's round trips: Megatron's DDP and distributed optimizer on torch's Adam, saved and
loaded with ``dist_checkpointing``, on 2 gloo ranks (DP=2: each rank owns half of every buffer).

A source run: a one-layer GPT (local spec), ``DistributedDataParallel``, ``get_megatron_optimizer``
(Adam, distributed optimizer; on a CPU host without Transformer Engine or Apex Megatron takes
``torch.optim.Adam``), ``STEPS`` real optimizer steps on deterministic gradients, saved with the
case's ``distrib_optim_sharding_type``; then one more step, the reference. A target run (other
initial values) is built ``fresh`` (no step taken: the optimizer has no state) or ``initialised``
(one step taken before the load, as after a warm-up or a failed attempt), asks for its load request
with ``sharded_state_dict(is_loading=True)``, loads and then takes the same next step.

Checked on every rank, in this order: the load request and the load complete (phases
``load_request``, ``load``); every parameter's ``state['step']`` is the checkpoint's (phase ``step``,
one ``AssertionError`` line otherwise), each in a tensor of its own, and torch's param groups hold
what the source run's held (no step: torch's Adam keeps it per parameter); the main-parameter shards, ``exp_avg`` and ``exp_avg_sq``
and the model parameters equal what was saved (``max_delta``); after one more step they equal the
uninterrupted run's (``next/...`` keys of ``max_delta``).

What is not real: the gradients (filled into DDP's gradient buffer as a reduce would leave them,
the same on both ranks), so that no forward pass is needed. ``device="cuda"`` tensors Megatron's
optimizer allocates are made on the CPU (``cuda_to_cpu_mode``), as in every CPU round trip here.
"""

from __future__ import annotations

import contextlib
import os
import zlib

import torch
import torch.distributed as dist

from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 3  # the source run's optimizer steps before the save
SOURCE_SEED, TARGET_SEED = 1234, 98765
# case -> (distrib_optim_sharding_type, whether the target has taken a step before the load)
CASES = {
    "fresh_load": ("dp_reshardable", False),
    "stale_step": ("dp_reshardable", True),
    "fully_reshardable": ("fully_reshardable", True),
    "fresh_fully_reshardable": ("fully_reshardable", False),
}


def prepare() -> None:
    """Run in the parent before any world starts: every forked world starts warm (and its first
    save's writer queue is forked, see testing/worker.py)."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401


def dp_reshardable_keeps_step():
    """None where ``dp_reshardable`` can save torch Adam's 0-dim per-parameter step (0.16.0 on: it
    is kept out of the bucket tensors), else why the scenario does not run."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.sharded_param_state_dp_reshardable)
    if "'step'" in source or '"step"' in source:
        return None
    return "this release's dp_reshardable has no branch for torch Adam's 0-dim per-parameter step"


def _values(seed, *parts, shape):
    g = torch.Generator().manual_seed(zlib.crc32("/".join(str(p) for p in (seed,) + parts).encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _build(seed):
    """Model (DDP) and distributed optimizer with parameters drawn from ``seed`` (the same on both ranks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=8)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(_values(seed, "param", name, shape=p.shape))
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=None)
    # Float16Module: every parameter in bf16, as Megatron's training wraps a bf16 model (torch's
    # LayerNorm, the fallback without Apex, would otherwise keep fp32 parameters beside bf16 ones).
    model = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
    # bf16 with fp32 main parameters, as models train: the main-parameter shards are the
    # optimizer's own tensors (with fp32 model parameters they would be views of the model's).
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.01,
        use_distributed_optimizer=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    return model, get_megatron_optimizer(opt_config, [model])


def _step(model, opt, index):
    """One optimizer step on gradients drawn for step ``index`` (the reduced gradient every rank holds)."""
    model.zero_grad_buffer()
    opt.zero_grad()
    for name, p in model.module.named_parameters():
        p.main_grad.copy_(_values(SOURCE_SEED, "grad", index, name, shape=p.shape))
    ok, _, _ = opt.step()
    assert ok, "the optimizer skipped a step"


def _distributed(opt):
    """The DistributedOptimizers behind what ``get_megatron_optimizer`` returned (a ChainedOptimizer
    from some releases on, even for one)."""
    return getattr(opt, "chained_optimizers", None) or [opt]


def _local_state(model, opt):
    """This rank's main-parameter shards and Adam state per parameter, and the model parameters."""
    out = {}
    for name, p in model.module.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        for d in _distributed(opt):
            if p not in d.model_param_group_index_map:
                continue
            gi, go = d.model_param_group_index_map[p]
            main = d.optimizer.param_groups[gi]["params"][go]
            out[f"main/{name}"] = main.detach().clone()
            for k, v in d.optimizer.state[main].items():
                if k != "step":
                    out[f"{k}/{name}"] = v.detach().clone()
    return out


def _steps(opt):
    """Every parameter's ``state['step']`` (values), how many distinct tensors hold them, how many parameters."""
    steps = [s.get("step") for d in _distributed(opt) for s in d.optimizer.state.values()]
    return sorted({float(t) for t in steps if t is not None}), len({id(t) for t in steps}), len(steps)


def _group_keys(opt):
    """What torch's param groups hold besides their parameters (keys, per optimizer and group)."""
    return [sorted(k for k in g if k != "params") for d in _distributed(opt) for g in d.optimizer.param_groups]


def _request(model, opt, fmt, is_loading):
    metadata = {"distrib_optim_sharding_type": fmt}
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def _source(fmt, ckpt_dir, cache):
    """Save the source run (once per sharding type in a world); return (saved state, reference)."""
    if fmt not in cache:
        from megatron.core import dist_checkpointing

        model, opt = _build(SOURCE_SEED)
        for i in range(STEPS):
            _step(model, opt, i)
        path = os.path.join(ckpt_dir, fmt)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(_request(model, opt, fmt, False), path)
        saved = _local_state(model, opt)
        _step(model, opt, STEPS)
        cache[fmt] = (path, saved, _local_state(model, opt), _group_keys(opt))
    return cache[fmt]


def run_case(name, ckpt_dir, patched, cache=None):
    """One case (``CASES``) in a world whose parallel state is initialised: its RoundTrip result."""
    from megatron.core import dist_checkpointing

    fmt, initialised = CASES[name]
    rt = RoundTrip(case=name, sharding_type=fmt, steps=None)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        import megatron.core.optimizer.distrib_optimizer as do

        assert not do.HAVE_APEX_OR_TE, "Megatron imported a FusedAdam: this round trip needs torch's Adam"
        rt.phase("save")
        path, saved, reference, group_keys = _source(fmt, ckpt_dir, {} if cache is None else cache)
        model, opt = _build(TARGET_SEED)
        if initialised:
            _step(model, opt, 100)
        rt.phase("load_request")
        request = _request(model, opt, fmt, True)
        rt.phase("load")
        loaded = dist_checkpointing.load(request, path)
        model.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        rt.phase("step")
        values, tensors, params = _steps(opt)
        rt["steps"] = values
        if values != [float(STEPS)]:
            raise AssertionError(f"per-parameter step after the load: {values}, the checkpoint's: {float(STEPS)}")
        if tensors != params:
            raise AssertionError(f"{params} parameters share {tensors} step tensor(s) after the load")
        if _group_keys(opt) != group_keys:
            raise AssertionError(f"param groups after the load: {_group_keys(opt)}, before the save: {group_keys}")
        got = _local_state(model, opt)
        _step(model, opt, STEPS)
        after = _local_state(model, opt)
        rt.compare(saved, got)
        rt.compare(reference, after, prefix="next/")
    return rt.result


@contextlib.contextmanager
def _world():
    from megatron.core import parallel_state as mpu

    from ....testing.cpu_shims import cuda_to_cpu_mode

    mpu.initialize_model_parallel()
    try:
        with cuda_to_cpu_mode() if not torch.cuda.is_available() else contextlib.nullcontext():
            yield
    finally:
        with contextlib.suppress(Exception):
            mpu.destroy_model_parallel()


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (one source save per sharding type): ``{case: result}``."""
    cache, out = {}, {}
    with _world():
        for name in names or CASES:
            out[name] = run_case(name, ckpt_dir, patched, cache)
    return out


def _scenario(name):
    def scenario(rank, world_size, ckpt_dir, patched, device="cpu"):
        with _world():
            return run_case(name, ckpt_dir, patched)

    scenario.__name__ = scenario.__qualname__ = name
    return scenario


fresh_load = _scenario("fresh_load")
stale_step = _scenario("stale_step")
fully_reshardable = _scenario("fully_reshardable")
