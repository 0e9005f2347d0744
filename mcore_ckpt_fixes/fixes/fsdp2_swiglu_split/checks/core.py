"""fsdp2-swiglu-split's round trip: a SwiGLU MLP under Megatron's own ``TorchFullyShardedDataParallel``
(torch FSDP2, ``--use-torch-fsdp2``), TP=1, DP=2, on 2 gloo ranks, with Adam's two moments described
as Megatron's optimizers describe optimizer state (``make_sharded_optimizer_tensor`` of the
parameter's entry, which ``optim_state_to_sharding_state`` calls for every state tensor).

The MLP is Megatron's ``MLP`` (``gated_linear_unit=True``, SiLU, biases) of the local GPT layer
spec, its groups from ``parallel_state``; its values, and the moments exp_avg = 2p + 1 and
exp_avg_sq = p * p, are deterministic. Saved with ``dist_checkpointing.save`` (torch_dist), model
and moments together, then loaded

* into a fresh wrapped model of the same layout (every rank's own shards), and
* into the same MLP unsharded (no FSDP2: full tensors on every rank), which reads the
  checkpoint's global tensors as any other layout or a converter would.

Megatron's ``FP32Optimizer`` itself is not used: on torch 2.14 its map from optimizer state to
model entries (``get_param_id_to_sharded_param_map``) finds no FSDP2 parameter
(``DTensor.to_local()`` of a Parameter is a new object there), a loud error of its own.
Only Megatron's wrapper is shimmed, in the worker: it builds its ``DeviceMesh`` with ``"cuda"``
(:func:`cpu_wrapper_mesh`). The fix-off half saves and reloads its own layout exactly; loaded
unsharded, the rows of ``linear_fc1`` (weight, bias and their moments) are out of place, which
this round trip reports as its error (``load_unsharded``) with the saved row each loaded row of
``linear_fc1.weight`` holds.
"""

from __future__ import annotations

import contextlib
import zlib

import torch
import torch.distributed as dist

from ....testing.compare import max_abs_delta
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

SAVE_SEED, FRESH_SEED = 1234, 98765
HIDDEN, FFN = 8, 12  # linear_fc1: 24 rows, W rows 0-11, V rows 12-23; DP=2: 12 rows a rank
FC1 = ("linear_fc1.weight", "linear_fc1.bias")


def prepare() -> None:
    import torch.distributed.fsdp  # noqa: F401

    import megatron.core.dist_checkpointing  # noqa: F401

    # The writer's results queue is then made with a forked manager in each rank (testing/worker.py),
    # not a spawned interpreter per saving rank (5-10 s a world).
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401
    import megatron.core.distributed.torch_fully_sharded_data_parallel  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer.mlp  # noqa: F401


class _CpuDeviceMesh:
    """``DeviceMesh`` as Megatron's FSDP2 wrapper sees it: ``from_group(group, "cuda")`` on the CPU."""

    @staticmethod
    def from_group(group, device_type="cuda", *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


@contextlib.contextmanager
def cpu_wrapper_mesh():
    """Worker-only shim: ``TorchFullyShardedDataParallel`` hard-codes a CUDA mesh, whose DTensors
    would move their local tensors to CUDA. Restored on exit; nothing else is changed."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as wrapper

    saved = wrapper.DeviceMesh
    if torch.cuda.is_available():
        yield
        return
    wrapper.DeviceMesh = _CpuDeviceMesh
    try:
        yield
    finally:
        wrapper.DeviceMesh = saved


def _config():
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=True,
        gated_linear_unit=True,
        activation_func=F.silu,
    )


def _mlp(config, seed):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    spec = get_gpt_layer_local_spec().submodules.mlp
    submodules = getattr(spec, "submodules", None) or spec.keywords["submodules"]  # a partial from 0.18
    mlp = MLP(config, submodules)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            p.copy_(torch.randn(p.shape, generator=g))
    return mlp


def _moments(model):
    """Adam's moments as set from the parameters (local, no collective): exp_avg = 2p + 1,
    exp_avg_sq = p * p, DTensors where the parameters are."""
    with torch.no_grad():
        return {name: {"exp_avg": p * 2 + 1, "exp_avg_sq": p * p} for name, p in model.named_parameters()}


def _wrapped(config, seed):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    with cpu_wrapper_mesh():
        return TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(), _mlp(config, seed))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(model, moments):
    """{name: local tensor} of the parameters and of their exp_avg / exp_avg_sq."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = _local(p).detach().clone()
        for k, t in moments[name].items():
            out[f"{k}/{name}"] = _local(t).detach().clone()
    return out


def _sharded(model, moments):
    """The model's sharded state dict, and each moment described as Megatron's optimizers describe
    optimizer state: ``make_sharded_optimizer_tensor`` of the parameter's entry (a SwiGLU factory is
    reused with the state's local tensor as its data)."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megatron.core import parallel_state

    # What Megatron-LM's models pass down (0.16-0.18 layers index it; earlier ones ignore it).
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model_sd = model.sharded_state_dict(prefix="", metadata=metadata)
    optimizer = {
        f"{k}/{name}": make_sharded_optimizer_tensor(model_sd[name], t, f"optimizer.state.{k}")
        for name, state in moments.items()
        for k, t in state.items()
    }
    return {"model": model_sd, "optimizer": optimizer}


def _loaded(model, loaded):
    """{name: tensor} of what dist_checkpointing loaded for ``model``'s parameters and moments."""
    out = dict(loaded["optimizer"])
    out.update({name: loaded["model"][name] for name, _ in model.named_parameters()})
    return out


def saved_rows(full, got):
    """The saved row each loaded row of ``got`` holds (-1: none), as compact ranges."""
    rows = [next((j for j in range(full.shape[0]) if torch.equal(got[i], full[j])), -1) for i in range(got.shape[0])]
    spans, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1 or rows[i] < 0:
            spans.append(f"{rows[start]}-{rows[i - 1]}" if i - 1 > start else f"{rows[start]}")
            start = i
    return ", ".join(spans)


def fsdp2_mlp(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """Save under FSDP2 (DP=2), load in the same layout and unsharded; see the module docstring."""
    assert device == "cpu" and world_size == 2, "fsdp2-swiglu-split's round trip: 2 gloo ranks"
    from megatron.core import dist_checkpointing, parallel_state

    rt = RoundTrip(warnings=[])
    with rt.running():
        rt.phase("precondition")
        import megatron.core.transformer.mlp  # noqa: F401  (the target decided)

        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        config = _config()
        plain = _mlp(config, SAVE_SEED)
        full = _tensors(plain, _moments(plain))
        rt.phase("save")
        model = _wrapped(config, SAVE_SEED)
        moments = _moments(model.module)
        before = _tensors(model.module, moments)
        dist_checkpointing.save(_sharded(model.module, moments), ckpt_dir)
        dist.barrier()
        rt.phase("load")
        fresh = _wrapped(config, FRESH_SEED)
        with _swiglu_warnings(rt):
            got = _loaded(
                fresh.module, dist_checkpointing.load(_sharded(fresh.module, _moments(fresh.module)), ckpt_dir)
            )
        assert not rt.compare(before, got), f"tensors differ after load: {rt.differing()}"
        rt.phase("load_unsharded")
        plain = _mlp(config, FRESH_SEED)
        got = _loaded(plain, dist_checkpointing.load(_sharded(plain, _moments(plain)), ckpt_dir))
        deltas = {f"unsharded/{k}": max_abs_delta(full[k], got[k]) for k in sorted(full)}
        rt["max_delta"] = dict(sorted({**rt["max_delta"], **deltas}.items()))
        rt["n_tensors"] = len(rt["max_delta"])
        wrong = sorted(k for k, d in deltas.items() if d != 0.0)
        if wrong:
            w = FC1[0]
            rt.fail(
                f"SwiGLU rows out of place, loaded unsharded: {', '.join(wrong)}; "
                f"{w} holds saved rows {saved_rows(full[w], got[w])}"
            )
    return rt.result


def old_checkpoint(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """With the fix on: a checkpoint the release writes (its own ``MLP.sharded_state_dict``, W and V
    rows split per shard) loads back exactly in the same FSDP2 layout, with one warning naming the
    tensors; the tests' world only (with the fix off it is the plain same-layout round trip)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.transformer.mlp import MLP

    from ....engine.patching import original

    rt = RoundTrip(warnings=[])
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel()
        config = _config()
        rt.phase("save")
        model = _wrapped(config, SAVE_SEED)
        moments = _moments(model.module)
        before = _tensors(model.module, moments)
        release = original(MLP, "sharded_state_dict")
        with _mlp_method(release):
            dist_checkpointing.save(_sharded(model.module, moments), ckpt_dir)
        dist.barrier()
        rt.phase("load")
        fresh = _wrapped(config, FRESH_SEED)
        with _swiglu_warnings(rt):
            got = _loaded(
                fresh.module, dist_checkpointing.load(_sharded(fresh.module, _moments(fresh.module)), ckpt_dir)
            )
        assert not rt.compare(before, got), f"tensors differ after load: {rt.differing()}"
    return rt.result


@contextlib.contextmanager
def _swiglu_warnings(rt):
    """Record the SwiGLU layout warnings a load gives (``rt["warnings"]``, the text after the
    checkpoint path)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    rt["warnings"] = [str(w.message).split(": ", 1)[1] for w in caught if "SwiGLU linear_fc1" in str(w.message)]


@contextlib.contextmanager
def _mlp_method(method):
    """``MLP.sharded_state_dict`` is ``method`` for the duration (the release's: a checkpoint as an
    unfixed job writes it)."""
    from megatron.core.transformer.mlp import MLP

    saved = MLP.__dict__["sharded_state_dict"]
    MLP.sharded_state_dict = method
    try:
        yield
    finally:
        MLP.sharded_state_dict = saved


def cases(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """The tests' world: the scenario, then (fix on) a checkpoint the release wrote."""
    import os

    dirs = {name: os.path.join(ckpt_dir, name) for name in ("in_place", "old")}
    for d in dirs.values():
        os.makedirs(d, exist_ok=True)
    out = {"fsdp2_mlp": fsdp2_mlp(rank, world_size, dirs["in_place"], patched, device)}
    if patched:
        out["old_checkpoint"] = old_checkpoint(rank, world_size, dirs["old"], patched, device)
    return out
