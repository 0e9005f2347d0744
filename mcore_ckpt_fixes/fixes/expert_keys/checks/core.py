"""expert-keys round trips: a MoE layer's state as Megatron-FSDP hands it to an ``fsdp_dtensor``
checkpoint under expert parallelism, DCP save and load, every rank's shards compared.

What is real: ``parallel_state`` (EP=2 over a gloo world), Megatron-FSDP's meshes built by the real
``FullyShardedDataParallel._init_dist_index`` (the dense data-parallel mesh and the expert mesh),
``make_fsdp_dtensor`` with uneven chunk metadata (the call Megatron-FSDP makes for each parameter),
the checkpoint preprocessing (``megatron.training.checkpointing.preprocess_fsdp_dtensor_state_dict``
where the wheel ships ``megatron.training``, 0.17+; on 0.16 the same steps called from
``megatron.core``, as a Megatron-LM checkout of that release does), the optimizer's parameter
names (``DistributedOptimizer._param_name``, through the name bound in ``distrib_optimizer``), and
torch DCP save/load (strict load: a missing key fails).

What is built by hand, and why: the model. Its expert layer is Transformer Engine's grouped MLP
(``TEGroupedMLP``: ``linear_fc1.weight{i}`` / ``linear_fc1.bias{i}`` / ``linear_fc2.*{i}``, one tensor
per local expert), and TE cannot be installed on a CPU host, nor can Megatron-FSDP's CUDA buffers be
built here. So the stand-in is a plain module tree with exactly those parameter names, wrapped the way
``FullyShardedDataParallel(MegatronFSDP(model))`` names them (``module.module.``), each parameter this
rank's row-aligned uneven FSDP shard of its tensor as a DTensor on the mesh Megatron-FSDP would use
(experts: the expert mesh, over the expert-data-parallel ranks; the rest: the dense mesh), plus Adam
state (``exp_avg``, ``exp_avg_sq``, ``step``) keyed by the optimizer's names.

Values are a function of (seed, tensor name, *global* expert index) only: each rank knows what every
other rank saved, so a wrong load is reported as which rank's values it got (``loaded_from``).
"""

from __future__ import annotations

import types
import zlib

import torch
import torch.distributed as dist

from ....testing.meshes import cpu_device_meshes
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import BRIDGE as _BRIDGE, ID as FIX_ID, MODULE as _MODULE, TRAINING as _TRAINING

SAVE_SEED, FRESH_SEED = 1234, 98765
EP, NUM_EXPERTS = 2, 4
NUM_LOCAL = NUM_EXPERTS // EP
HIDDEN, FFN = 4, 6
LAYER = "decoder.layers.0"


def prepare() -> None:
    import torch.distributed.checkpoint  # noqa: F401

    import megatron.core.distributed.fsdp.mcore_fsdp_adapter  # noqa: F401
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    import megatron.core.transformer.fsdp_dtensor_checkpoint  # noqa: F401

    try:
        import megatron.training.checkpointing  # noqa: F401  (0.17+ wheels, Megatron-LM checkouts)
    except ImportError:
        pass


# Expert layouts of the TE grouped MLP: "indexed" (one tensor per local expert: weight{i}, bias{i});
# "grouped" (moe_single_grouped_weight + moe_single_grouped_bias, 0.18+: one tensor per GEMM, dim 0
# the local expert); "grouped_bias" (indexed weights, one grouped bias: moe_single_grouped_bias
# alone, the one a CPU-free config can reach, since single grouped weights need fp8/mxfp8).
GROUPED = "all"  # marks a grouped tensor in _shapes: dim 0 holds every local expert
_EXPERT_SHAPES = {
    "linear_fc1.weight": (FFN, HIDDEN),
    "linear_fc1.bias": (FFN,),
    "linear_fc2.weight": (HIDDEN, FFN),
    "linear_fc2.bias": (HIDDEN,),
}


def _shapes(variant="indexed"):
    """{local parameter name: (shape, local expert index, GROUPED, or None)} for this layer."""
    out = {
        f"{LAYER}.self_attention.linear_proj.weight": ((HIDDEN, HIDDEN), None),
        f"{LAYER}.self_attention.linear_proj.bias": ((HIDDEN,), None),
        f"{LAYER}.mlp.router.weight": ((NUM_EXPERTS, HIDDEN), None),
    }
    for param, shape in _EXPERT_SHAPES.items():
        grouped = variant == "grouped" or (variant == "grouped_bias" and param.endswith("bias"))
        if grouped:
            out[f"{LAYER}.mlp.experts.{param}"] = ((NUM_LOCAL, *shape), GROUPED)
        else:
            for i in range(NUM_LOCAL):
                out[f"{LAYER}.mlp.experts.{param}{i}"] = (shape, i)
    return out


def _values(seed, name, shape, local_index, ep_rank, what="param"):
    """The full (unsharded) tensor ``name`` as EP rank ``ep_rank`` holds it: experts by global index
    (a grouped tensor is its experts' tensors stacked, so its values depend on the EP rank too)."""
    if local_index == GROUPED:
        return torch.stack([_values(seed, name, shape[1:], i, ep_rank, what) for i in range(NUM_LOCAL)])
    generic = name
    if local_index is not None:
        generic = name.rstrip("0123456789") + str(ep_rank * NUM_LOCAL + local_index)
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{what}/{generic}".encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _cut(rows, dp_rank, dp_size):
    """Row-aligned, uneven FSDP cut of ``rows`` rows (Megatron-FSDP slices a flat bucket evenly, so a
    single parameter's share is uneven, possibly empty): (first row, end row) of ``dp_rank``."""
    bounds = [min(rows, -(-rows * k * 5 // (4 * dp_size))) for k in range(dp_size)] + [rows]
    return bounds[dp_rank], bounds[dp_rank + 1]


def _adapter_class(adapter):
    """The Megatron-FSDP adapter class that builds the meshes: ``FullyShardedDataParallel`` up to
    0.19; on Megatron-LM main that name is a factory and ``FullyShardedDataParallelV1`` the class."""
    cls = adapter.FullyShardedDataParallel
    if not hasattr(cls, "_init_dist_index"):
        cls = getattr(adapter, "FullyShardedDataParallelV1", cls)
    return cls


class _Layout:
    """This rank's coordinates, and every rank's, from the real parallel_state / Megatron-FSDP meshes."""

    def __init__(self):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

        ps.initialize_model_parallel(expert_model_parallel_size=EP)
        self.ep_rank = ps.get_expert_model_parallel_rank()
        edp = ps.get_expert_data_parallel_group()
        dp = ps.get_data_parallel_group(with_context_parallel=True)
        self.edp_rank, self.edp_size = edp.rank(), edp.size()
        self.dp_rank, self.dp_size = dp.rank(), dp.size()
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads_params",
            num_distributed_optimizer_instances=1,
        )
        # The real mesh construction of FullyShardedDataParallel.__init__ (the rest of __init__ builds
        # Megatron-FSDP's CUDA buffers, which a CPU host cannot), its meshes on the CPU.
        with cpu_device_meshes():
            # What __init__ has set on the wrapper by then (0.18+ reads num_moe_experts).
            wrapper = types.SimpleNamespace(ddp_config=ddp_config, num_moe_experts=NUM_EXPERTS)
            self.index = _adapter_class(adapter)._init_dist_index(wrapper, None)
        coords = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.ep_rank, self.edp_rank, self.dp_rank))
        self.coords = coords  # rank -> (ep rank, expert-dp rank, dense-dp rank)

    def shard_of(self, rank, name, full, is_expert):
        ep_rank, edp_rank, dp_rank = self.coords[rank]
        r0, r1 = (
            _cut(full.shape[0], edp_rank, self.edp_size) if is_expert else _cut(full.shape[0], dp_rank, self.dp_size)
        )
        return full[r0:r1]


def _dtensor(layout, shard, full_shape, is_expert):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    template = torch.nn.Parameter(torch.empty(full_shape), requires_grad=False)
    return make_fsdp_dtensor(
        shard.clone(),
        template,
        layout.index,
        is_sharded_param=True,
        is_expert_param=is_expert,
        update_uneven_dtensor_chunk_meta=True,
    )


class _Chunk(torch.nn.Module):
    """``FullyShardedDataParallel`` -> ``MegatronFSDP`` -> model: parameter names ``module.module.*``."""

    def __init__(self, inner):
        super().__init__()
        self.module = torch.nn.Module()
        self.module.module = inner
        # What the preprocessing reads of the model's config (Bridge: the expert count and whether
        # SwiGLU is on; no SwiGLU here).
        self.config = types.SimpleNamespace(num_moe_experts=NUM_EXPERTS, gated_linear_unit=False, activation_func=None)


def _build(layout, seed, variant="indexed"):
    """(model chunk, state dict to checkpoint, {compare key: expected local shard})."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    rank = dist.get_rank()
    inner = torch.nn.Module()
    params, expected = {}, {}
    shapes = _shapes(variant)
    for name, (shape, local_index) in shapes.items():
        is_expert = local_index is not None
        full = _values(seed, name, shape, local_index, layout.ep_rank)
        shard = layout.shard_of(rank, name, full, is_expert)
        param = torch.nn.Parameter(_dtensor(layout, shard, shape, is_expert), requires_grad=False)
        owner = inner
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, param)
        params[name] = param
        expected[f"model/{name}"] = shard
    chunk = _Chunk(inner)
    # Optimizer state keyed as the distributed optimizer names it for fsdp_dtensor checkpoints.
    namer = types.SimpleNamespace(model_chunks=[chunk])
    state = {}
    for name, param in params.items():
        shape, local_index = shapes[name]
        is_expert = local_index is not None
        entry = {"step": torch.tensor(float(seed % 97))}
        for sub in ("exp_avg", "exp_avg_sq"):
            full = _values(seed, name, shape, local_index, layout.ep_rank, what=sub)
            shard = layout.shard_of(rank, name, full, is_expert)
            entry[sub] = _dtensor(layout, shard, shape, is_expert)
            expected[f"optimizer/{name}/{sub}"] = shard
        state[DistributedOptimizer._param_name(namer, param)] = entry
    return chunk, {"model": dict(params), "optimizer": {"state": state}}, expected


def _preprocess(chunk, state, via="release"):
    """The fsdp_dtensor checkpoint preprocessing of this release (save and load alike), or with
    ``via="bridge"`` Megatron-Bridge's own (``preprocess_fsdp_dtensor_state_dict(cfg, state, model)``,
    which reads the expert count and SwiGLU from the model's config)."""
    args = types.SimpleNamespace(swiglu=False, num_experts=NUM_EXPERTS)
    if via == "bridge":
        from megatron.bridge.training.checkpointing import preprocess_fsdp_dtensor_state_dict as bridge

        return bridge(None, state, chunk), _BRIDGE
    try:
        from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict
    except ImportError:  # 0.16 wheel: the same steps, from megatron.core
        import sys

        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            preprocess_state_dict_for_uneven_dtensor,
        )

        upstream = sys.modules[_MODULE]
        state = dict(state)
        upstream.handle_fp8_extra_state_case(state["model"])
        state["model"] = upstream.handle_experts_in_state_dict(state["model"], args.num_experts)
        preprocess_state_dict_for_uneven_dtensor(state)
        return state, "megatron.core (0.16: megatron.training not in the wheel)"
    return preprocess_fsdp_dtensor_state_dict(args, state, chunk), "megatron.training.checkpointing"


def _collect(state, chunk):
    """{compare key: this rank's local shard} out of the loaded parameters and optimizer state."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    namer = types.SimpleNamespace(model_chunks=[chunk])
    params = dict(chunk.module.module.named_parameters())
    out = {}
    for name, param in params.items():
        out[f"model/{name}"] = param.to_local()
        opt_name = DistributedOptimizer._param_name(namer, param)
        for sub in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer/{name}/{sub}"] = state["optimizer"]["state"][opt_name][sub].to_local()
    return out


def _fix_state(patched, variant="indexed", via="release"):
    # Grouped tensors are made EP-global through the caller's binding of the preprocessing.
    site = _BRIDGE if via == "bridge" else _TRAINING
    return fix_states(FIX_ID, (_MODULE,) if variant == "indexed" else (_MODULE, site), patched)


def _sources(layout, key, got, variant):
    """The ranks whose saved local shard of ``key`` equals ``got`` (what a wrong load picked up)."""
    kind, rest = key.split("/", 1)
    name, _, sub = rest.partition("/")
    shape, local_index = _shapes(variant)[name]
    found = []
    for rank, (ep_rank, _, _) in enumerate(layout.coords):
        full = _values(SAVE_SEED, name, shape, local_index, ep_rank, what=sub or "param")
        shard = layout.shard_of(rank, name, full, local_index is not None)
        if shard.shape == got.shape and torch.equal(shard, got):
            found.append(rank)
    return found


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu", variant="indexed", via="release"):
    if device != "cpu":
        raise ValueError("expert-keys scenarios run on CPU (gloo) only")
    rt = RoundTrip(device="cpu", loaded_from={}, via=None)
    rt.phase("setup")
    from megatron.core import parallel_state as ps

    try:
        with rt.running():  # records DCP's CheckpointException too (a BaseException)
            layout = _Layout()
            rt["coords"] = layout.coords
            expected = _save(rt, layout, ckpt_dir, patched, variant, via)
            _load_and_compare(rt, layout, ckpt_dir, variant, expected, via)
    finally:
        ps.destroy_model_parallel()
    return rt.result


def _save(rt, layout, ckpt_dir, patched, variant, via="release"):
    """Build, preprocess and save this rank's state; {compare key: expected local shard}."""
    import torch.distributed.checkpoint as dcp

    chunk, state, expected = _build(layout, SAVE_SEED, variant)
    rt.phase("precondition")
    rt["fix_state"] = _fix_state(patched, variant, via)
    rt.phase("preprocess")
    raw = {(n, sub): v for n, entry in state["optimizer"]["state"].items() for sub, v in entry.items()}
    to_save, rt["via"] = _preprocess(chunk, state, via)
    # The caller's optimizer dicts (Megatron loads the optimizer from them afterwards) keep the
    # parameter-shaped tensors, whatever the preprocessing put in the dict it checkpoints.
    rt["raw_state_kept"] = all(state["optimizer"]["state"][n][sub] is v for (n, sub), v in raw.items())
    rt["saved_keys"] = sorted(to_save["model"])
    rt.phase("save")
    dcp.save(to_save, checkpoint_id=ckpt_dir)
    dist.barrier()
    # The global shape the checkpoint records for each expert tensor of the model (metadata only).
    stored = dcp.FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    rt["stored_shapes"] = {
        k[len("model.") :]: list(md.size) for k, md in stored.items() if k.startswith("model.") and ".experts." in k
    }
    return expected


def _load_and_compare(rt, layout, ckpt_dir, variant, expected, via="release"):
    """Load into a fresh state (strict: a missing key fails) and compare with what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    rt.phase("build_fresh")
    fresh_chunk, fresh_state, fresh_expected = _build(layout, FRESH_SEED, variant)
    same = [k for k, v in expected.items() if v.numel() and torch.equal(v, fresh_expected[k])]
    assert not same, f"fresh state already equals the saved one on {same}: the check would be vacuous"
    rt.phase("load_preprocess")
    to_load, _ = _preprocess(fresh_chunk, fresh_state, via)
    rt.phase("load")
    dcp.load(to_load, checkpoint_id=ckpt_dir, planner=DefaultLoadPlanner(allow_partial_load=False))
    rt.phase("compare")
    # Read back from the dicts Megatron keeps (the parameters, the raw optimizer state: after an
    # fsdp_dtensor load it puts raw_optimizer_state_dict back), not from the preprocessed copy.
    got = _collect(fresh_state, fresh_chunk)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    bad = sorted(rt.compare(expected, got))
    rt["loaded_from"] = {k: _sources(layout, k, got[k], variant) for k in bad}
    assert not bad, f"tensors differ after load: {bad}"


def ep2(rank, world_size, ckpt_dir, patched, device="cpu"):
    """EP=2 on 2 ranks: each rank owns 2 of 4 TE grouped experts (expert-data-parallel size 1)."""
    assert world_size == 2, f"ep2 needs 2 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device)


def ep2_dp2(rank, world_size, ckpt_dir, patched, device="cpu"):
    """EP=2 x expert-DP=2 on 4 ranks: expert shards cut unevenly over the expert mesh, dense over 4."""
    assert world_size == 4, f"ep2_dp2 needs 4 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device)


def ep2_grouped(rank, world_size, ckpt_dir, patched, device="cpu"):
    """EP=2 on 2 ranks, single grouped expert tensors (moe_single_grouped_weight and _bias, 0.18+)."""
    assert world_size == 2, f"ep2_grouped needs 2 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device, variant="grouped")


def ep2_grouped_bias(rank, world_size, ckpt_dir, patched, device="cpu"):
    """EP=2 on 2 ranks, indexed expert weights beside one grouped bias per GEMM (moe_single_grouped_bias)."""
    assert world_size == 2, f"ep2_grouped_bias needs 2 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device, variant="grouped_bias")


def ep2_dp2_grouped(rank, world_size, ckpt_dir, patched, device="cpu"):
    """EP=2 x expert-DP=2 on 4 ranks, single grouped expert tensors cut unevenly over expert DP."""
    assert world_size == 4, f"ep2_dp2_grouped needs 4 ranks, got {world_size}"
    return round_trip(rank, world_size, ckpt_dir, patched, device, variant="grouped")


def save_ep2(rank, world_size, ckpt_dir, patched, device="cpu", variant="indexed"):
    """EP=2 on 2 ranks: save only (the fix on or off, as the process was started)."""
    import torch.distributed.checkpoint as dcp

    from megatron.core import parallel_state as ps

    assert world_size == 2 and device == "cpu", (world_size, device)
    try:
        layout = _Layout()
        chunk, state, _ = _build(layout, SAVE_SEED, variant)
        fix_state = _fix_state(patched)
        to_save, _ = _preprocess(chunk, state)
        dcp.save(to_save, checkpoint_id=ckpt_dir)
        dist.barrier()
        return {"fix_state": fix_state, "saved_keys": sorted(to_save["model"]), "ep_rank": layout.ep_rank}
    finally:
        ps.destroy_model_parallel()


def load_ep2(rank, world_size, ckpt_dir, patched, device="cpu", variant="indexed"):
    """EP=2 on 2 ranks: load what ``save_ep2`` wrote the way ``_load_base_checkpoint`` loads an
    fsdp_dtensor checkpoint by default: the checkpoint's DCP metadata, ``print_diff_in_state_dicts``
    (through the name ``megatron.training.checkpointing`` binds, 0.17+; on 0.16 the megatron.core
    one, which a Megatron-LM checkout of that release calls), then a partial DCP load."""
    import sys
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron.core import parallel_state as ps

    assert world_size == 2 and device == "cpu", (world_size, device)
    try:
        layout = _Layout()
        fix_state = _fix_state(patched)
        chunk, state, fresh = _build(layout, FRESH_SEED, variant)
        to_load, via = _preprocess(chunk, state)
        metadata = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
        try:
            from megatron.training import checkpointing as site
        except ImportError:
            site = sys.modules[_MODULE]
        requested = sorted(sys.modules[_MODULE].flatten_state_dict(to_load))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            site.print_diff_in_state_dicts(metadata, to_load)
            dcp.load(to_load, checkpoint_id=ckpt_dir, planner=DefaultLoadPlanner(allow_partial_load=True))
        got = _collect(state, chunk)  # the dicts Megatron keeps (see round_trip)
        return {
            "fix_state": fix_state,
            "ep_rank": layout.ep_rank,
            "site": site.__name__,
            "warnings": [str(w.message) for w in caught if w.category.__name__ == "MegatronPatchWarning"],
            "not_in_checkpoint": [k for k in requested if k not in metadata],
            # compare keys (local names) whose tensors still hold the fresh values: not loaded
            "not_loaded": sorted(k for k, v in got.items() if v.numel() and torch.equal(v, fresh[k])),
            # compare keys that were loaded but hold other values than this rank saved, and whose they are
            "loaded_from": {
                k: _sources(layout, k, v, variant)
                for k, v in got.items()
                if v.numel() and not torch.equal(v, fresh[k]) and _sources(layout, k, v, variant) != [rank]
            },
        }
    finally:
        ps.destroy_model_parallel()
