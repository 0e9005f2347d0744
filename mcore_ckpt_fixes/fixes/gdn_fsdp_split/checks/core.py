"""gdn-fsdp-split round trips: GDN fused projections as Megatron-FSDP DTensors through
``handle_gdn_in_state_dict``, DCP save, load and re-fuse, on a CPU DeviceMesh with gloo.

What is real: ``handle_gdn_in_state_dict`` (upstream's or the fix's), Megatron-FSDP's
``FSDPDistributedIndex`` / ``make_fsdp_dtensor`` / ``update_uneven_dtensor_chunk_metadata`` (the
parameters are built by the same calls Megatron-FSDP makes), torch DCP save/load.

What is a stand-in, and why: the model. A real ``GatedDeltaNet`` needs the ``fla`` Triton kernels
and Megatron-FSDP's buffers need CUDA; ``handle_gdn_in_state_dict`` only reads a GDN module's
``qk_dim`` / ``v_dim`` / ``in_proj_dim`` / ``num_value_heads`` / ``tp_size`` and the parameters'
Megatron-FSDP attributes (``megatron_fsdp_slice``, ``megatron_fsdp_dist_index``, TP attributes), so
the stand-in has exactly those, with parameters built as Megatron-FSDP builds them: the TP-local
fused tensor, cut into row-aligned uneven FSDP shards across the dp-shard mesh dimension (the cut
falls inside a component), wrapped by ``make_fsdp_dtensor`` with uneven chunk metadata.

Layouts of the state handed to ``handle_gdn_in_state_dict``:

* ``tp_global``: the parameter DTensor itself (global shape = TP-global), as Megatron-FSDP's
  ``state_dict()`` returns it. Upstream handles it; the fix must write the same checkpoint.
* ``tp_local``: the same local shard as a DTensor whose *global* shape is the TP-local shape (built by
  ``make_fsdp_dtensor`` from a TP-local tensor without TP attributes), as Megatron-Bridge and verl
  hand it over. 0.18 applies the TP split twice here.
* ``mixed``: rank 0 holds ``tp_global`` data and DTensor optimizer state, rank 1 ``tp_local`` data
  and plain-Tensor (FusedAdam-style) optimizer state: the ranks would choose different branches.

``.cuda()`` is a no-op inside these workers on a CUDA-less host (``validate_uneven_dtensor`` moves its
boundary flags to CUDA); never installed by ``import mcore_ckpt_fixes``.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ....testing.result import RoundTrip
from ....testing.states import ON, fix_states
from .. import ID as FIX_ID, MODULE as _MODULE

SAVE_SEED, FRESH_SEED = 1234, 98765
# Global GDN dims: qk = 2 heads x 4, v = 4 heads x 3, so components have distinct sizes.
NUM_K_HEADS, K_HEAD_DIM, NUM_V_HEADS, V_HEAD_DIM = 2, 4, 4, 3
HIDDEN, KERNEL = 6, 4
PATH = "decoder.layers.0.self_attention"


def prepare() -> None:
    import torch.distributed.checkpoint  # noqa: F401

    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer  # noqa: F401
    import megatron.core.transformer.fsdp_dtensor_checkpoint  # noqa: F401


def _cpu_cuda_shim():
    if not torch.cuda.is_available() and not getattr(torch.Tensor.cuda, "_mcore_ckpt_fixes_shim", False):

        def cuda(self, *args, **kwargs):
            return self

        cuda._mcore_ckpt_fixes_shim = True
        torch.Tensor.cuda = cuda


# -- the stand-in model ----------------------------------------------------------------------------


class GdnStandIn(torch.nn.Module):
    """What ``handle_gdn_in_state_dict`` sees of a ``GatedDeltaNet``."""

    def __init__(self, tp):
        super().__init__()
        self.qk_dim = NUM_K_HEADS * K_HEAD_DIM
        self.v_dim = NUM_V_HEADS * V_HEAD_DIM
        self.num_value_heads = NUM_V_HEADS
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * NUM_V_HEADS
        self.tp_size = tp
        self.in_proj = torch.nn.Module()
        self.conv1d = torch.nn.Module()
        self.out_proj = torch.nn.Module()


def local_shapes(tp):
    """TP-local shapes of the fused tensors (and one non-GDN tensor)."""
    qk, v, nvh = NUM_K_HEADS * K_HEAD_DIM // tp, NUM_V_HEADS * V_HEAD_DIM // tp, NUM_V_HEADS // tp
    conv = 2 * qk + v
    return {
        "in_proj.weight": (2 * qk + 2 * v + 2 * nvh, HIDDEN),
        "conv1d.weight": (conv, 1, KERNEL),
        "conv1d.bias": (conv,),
        "out_proj.weight": (HIDDEN, v),  # row-parallel, not split by the GDN handler
    }


def _values(seed, tp_rank, name, shape):
    # crc32, not hash(): ranks must agree across processes.
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{tp_rank}/{name}".encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _fsdp_rows(rows, dp_rank, dp_size):
    """Row-aligned, uneven FSDP shard of ``rows`` rows (Megatron-FSDP cuts a flat bucket evenly,
    so one parameter's share is uneven; the cut falls inside a component)."""
    if dp_size == 1:
        return 0, rows
    cut = (rows * 5) // 8
    return (0, cut) if dp_rank == 0 else (cut, rows)


class _World:
    def __init__(self, tp):
        from torch.distributed.device_mesh import init_device_mesh
        from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

        world = dist.get_world_size()
        self.tp, self.dp = tp, world // tp
        self.mesh = init_device_mesh("cpu", (self.dp, tp), mesh_dim_names=("dp_shard", "tp"))
        self.index = FSDPDistributedIndex(device_mesh=self.mesh, dp_shard_dim="dp_shard", tp_dim="tp")
        self.tp_rank = self.mesh.get_local_rank(1)
        self.dp_rank = self.mesh.get_local_rank(0)


def _make_param(w, name, full_local, tp_attrs=True):
    """A Megatron-FSDP distributed parameter: this rank's FSDP shard of the TP-local tensor."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    rows = full_local.shape[0]
    row_numel = full_local[0].numel() if full_local.dim() > 1 else 1
    r0, r1 = _fsdp_rows(rows, w.dp_rank, w.dp)
    shard = full_local.reshape(-1)[r0 * row_numel : r1 * row_numel].clone()
    template = torch.nn.Parameter(torch.empty(full_local.shape), requires_grad=False)
    if tp_attrs and w.tp > 1:
        template.tensor_model_parallel, template.partition_dim, template.partition_stride = True, 0, 1
        if name == "out_proj.weight":
            template.partition_dim = 1
    dt = make_fsdp_dtensor(shard, template, w.index, is_sharded_param=True, update_uneven_dtensor_chunk_meta=True)
    param = torch.nn.Parameter(dt, requires_grad=False)
    if tp_attrs:
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(template, attr):
                setattr(param, attr, getattr(template, attr))
        param.megatron_fsdp_dist_index = w.index
        param.megatron_fsdp_slice = slice(r0 * row_numel, r1 * row_numel)
    return param, shard


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.module = inner


def _model_around(gdn):
    """``module.decoder.layers.0.self_attention`` = the GDN stand-in, as a wrapped GPT model names it."""
    inner = torch.nn.Module()
    inner.decoder = torch.nn.Module()
    inner.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    inner.decoder.layers[0].self_attention = gdn
    return _Wrapper(inner)


def _build(w, seed, layout, optimizer):
    """(model, model_state_dict, optimizer_state_dict, expected local shards by key)."""
    gdn = GdnStandIn(w.tp)
    expected = {}
    for name, shape in local_shapes(w.tp).items():
        full = _values(seed, w.tp_rank, name, shape)
        param, shard = _make_param(w, name, full)
        owner = getattr(gdn, name.split(".")[0])
        owner.register_parameter(name.split(".")[1], param)
        expected[f"{PATH}.{name}"] = shard
    model = _model_around(gdn)

    model_layout = layout if layout != "mixed" else ("tp_global" if dist.get_rank() == 0 else "tp_local")
    msd = {}
    for key, param in ((k, model.module.get_parameter(k)) for k in expected):
        if model_layout == "tp_global" or key.endswith("out_proj.weight"):
            msd[key] = param
        else:
            name = key[len(PATH) + 1 :]
            msd[key] = _make_param(w, name, _values(seed, w.tp_rank, name, local_shapes(w.tp)[name]), tp_attrs=False)[0]
    osd = None
    if optimizer:
        state = {}
        for key in list(expected):
            name = key[len(PATH) + 1 :]
            entry = {"step": torch.tensor(7.0)}
            for sub in ("exp_avg", "exp_avg_sq"):
                full = _values(seed, w.tp_rank, f"{name}/{sub}", local_shapes(w.tp)[name])
                # Setup collectives must pair across ranks: every rank builds the TP-global DTensor
                # (it also gives the expected local shard); TP-local ones only gather over dp_shard.
                state_param, expected[f"opt/{key}/{sub}"] = _make_param(w, name, full)
                gdn_key = not key.endswith("out_proj.weight")
                if layout == "mixed" and dist.get_rank() == 1 and gdn_key:
                    entry[sub] = state_param.to_local()  # FusedAdam-style plain local shard
                elif model_layout == "tp_local" and gdn_key:
                    entry[sub] = _make_param(w, name, full, tp_attrs=False)[0]
                else:
                    entry[sub] = state_param
            state[f"module.module.{key}"] = entry
        osd = {"state": state, "param_groups": [{"lr": 1.0, "params": list(state)}]}
    return model, msd, osd, expected


def _handle():
    import sys

    return sys.modules[_MODULE].handle_gdn_in_state_dict


def _gdn_keys():
    return [f"{PATH}.{n}" for n in ("in_proj.weight", "conv1d.weight", "conv1d.bias")]


def _refuse(msd, osd):
    """Re-fuse the split pieces: (this rank's local shard of each fused tensor, by key; the sizes of
    its components, by key). A load that mixes up ranks takes each component from one rank: the
    comparison fingerprints them one by one (RoundTrip.compare's ``parts``)."""
    from torch.distributed.tensor import DTensor

    names = {
        "in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
        "conv1d.weight": ("query", "key", "value"),
        "conv1d.bias": ("query", "key", "value"),
    }
    out, parts = {}, {}

    def loc(t):
        return (t.to_local() if isinstance(t, DTensor) else t).reshape(-1)

    def fuse(out_key, pieces):
        out[out_key] = torch.cat(pieces)
        parts[out_key] = [p.numel() for p in pieces]

    for key in _gdn_keys():
        subs = names[key[len(PATH) + 1 :]]
        fuse(key, [loc(msd[f"{key}.{s}"]) for s in subs])
        if osd is not None:
            for sub in ("exp_avg", "exp_avg_sq"):
                fuse(f"opt/{key}/{sub}", [loc(osd["state"][f"module.module.{key}.{s}"][sub]) for s in subs])
    key = f"{PATH}.out_proj.weight"
    if key not in msd:  # the plain TP=2 layouts leave the non-GDN tensor out
        return out, parts
    out[key] = loc(msd[key])
    if osd is not None:
        for sub in ("exp_avg", "exp_avg_sq"):
            out[f"opt/{key}/{sub}"] = loc(osd["state"][f"module.module.{key}"][sub])
    return out, parts


def _short(exc):
    msg = str(exc).split(" Offsets: ")[0]  # rank-specific detail after the sentence
    return f"{type(exc).__name__}: {msg}"


def _round_trip_result(**extra):
    """This scenario's RoundTrip: the error line cut before rank-specific detail, and the full text
    also as ``error_detail`` (the name these results have always used for it)."""
    return RoundTrip(error_line=_short, **extra)


def _finish(rt):
    if rt["error"] is not None:
        rt["error_detail"] = rt["raw_error"]
    return rt.result


def _fix_state(patched):
    return fix_states(FIX_ID, (_MODULE,), patched, accept=ON + ("not-applicable",))


def _dcp_state(msd, osd):
    """What Megatron's fsdp_dtensor save hands DCP: the model state and the optimizer's per-param state."""
    state = {"model": msd}
    if osd is not None:
        state["optimizer"] = {"state": osd["state"]}
    return state


def round_trip(
    rank, world_size, ckpt_dir, patched, device="cpu", tp=2, layout="tp_local", optimizer=False, global_check=True
):
    import torch.distributed.checkpoint as dcp

    if device != "cpu":
        raise ValueError("gdn-fsdp-split scenarios run on CPU (gloo) only")
    _cpu_cuda_shim()
    rt = _round_trip_result(device="cpu", layout=layout, tp=tp, optimizer=optimizer)
    rt.phase("setup")
    with rt.running():  # records DCP's CheckpointException too (a BaseException)
        w = _World(tp)
        model, msd, osd, expected = _build(w, SAVE_SEED, layout, optimizer)
        rt.phase("precondition")
        rt["fix_state"] = _fix_state(patched)
        rt.phase("preprocess")
        msd_s, osd_s = _handle()(model, msd, osd)
        rt.phase("save")
        dcp.save(_dcp_state(msd_s, osd_s), checkpoint_id=ckpt_dir)
        dist.barrier()
        rt.phase("build_fresh")
        fmodel, fmsd, fosd, fexpected = _build(w, FRESH_SEED, layout, optimizer)
        rt.phase("load_preprocess")
        fmsd_s, fosd_s = _handle()(fmodel, fmsd, fosd)
        rt.phase("load")
        fstate = _dcp_state(fmsd_s, fosd_s)
        dcp.load(fstate, checkpoint_id=ckpt_dir)
        rt.phase("compare")
        got, parts = _refuse(fstate["model"], fstate.get("optimizer"))
        assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
        bad = rt.compare(expected, got, parts=parts)
        assert not bad, f"tensors differ after load: {bad}"
        if global_check:
            rt.phase("global_check")
            rt["global_max_delta"] = _global_check(w, ckpt_dir)
            bad = {k: d for k, d in rt["global_max_delta"].items() if d != 0.0}
            assert not bad, f"saved components are not the TP-global ones: {bad}"
    return _finish(rt)


def _global_check(w, ckpt_dir):
    """Read each saved component whole: it must be the TP-global component (all TP ranks' parts in
    TP order), i.e. the layout a checkpoint of any TP size can be resharded from."""
    import torch.distributed.checkpoint as dcp

    names = {
        "in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
        "conv1d.weight": ("query", "key", "value"),
        "conv1d.bias": ("query", "key", "value"),
    }
    deltas, want, read = {}, {}, {}
    for name, subs in names.items():
        parts = [
            list(torch.split(_values(SAVE_SEED, t, name, local_shapes(w.tp)[name]), _sizes(w.tp, name), dim=0))
            for t in range(w.tp)
        ]
        for i, s in enumerate(subs):
            full = torch.cat([parts[t][i] for t in range(w.tp)])
            key = f"{PATH}.{name}.{s}"
            want[key] = full
            read[key] = torch.full_like(full, float("nan"))
    dcp.load({"model": read}, checkpoint_id=ckpt_dir)
    for key in want:
        deltas[key] = float((want[key] - read[key]).abs().nan_to_num(float("inf")).max())
    return deltas


def _sizes(tp, name):
    qk, v, nvh = NUM_K_HEADS * K_HEAD_DIM // tp, NUM_V_HEADS * V_HEAD_DIM // tp, NUM_V_HEADS // tp
    return [qk, qk, v, v, nvh, nvh] if name == "in_proj.weight" else [qk, qk, v]


# -- registered scenarios ------------------------------------------------------------------------


def tp2_local(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=2, TP-local GDN DTensors (the 0.18 double split), model state only."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=2, layout="tp_local", optimizer=False)


def tp2_local_optimizer(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=2, TP-local GDN DTensors, with Adam state (exp_avg, exp_avg_sq, step)."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=2, layout="tp_local", optimizer=True)


def tp2_global(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=2, Megatron-FSDP's own TP-global parameter DTensors, with optimizer state."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=2, layout="tp_global", optimizer=True)


def tp1(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=1, FSDP over both ranks (uneven shards cut inside a component), model state only."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=1, layout="tp_global", optimizer=False)


def tp1_optimizer(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=1, FSDP over both ranks, with optimizer state."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=1, layout="tp_global", optimizer=True)


def mixed_model(rank, world_size, ckpt_dir, patched, device="cpu"):
    """Hang safety, model state only: rank 0 TP-global DTensors, rank 1 TP-local DTensors (0.19
    sends rank 0 down make_fsdp_dtensor's collectives and rank 1 down split_dtensor's)."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=2, layout="mixed", optimizer=False)


def mixed(rank, world_size, ckpt_dir, patched, device="cpu"):
    """Hang safety: rank 0 TP-global DTensors + DTensor Adam state, rank 1 TP-local DTensors +
    plain-Tensor Adam state; upstream's branch choice differs between the ranks."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, tp=2, layout="mixed", optimizer=True)


# -- collective counting (benchmarks/gdn_collectives.py) -------------------------------------------

_COLLECTIVES = (
    "all_gather_object",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "gather_object",
    "scatter_object_list",
    "all_to_all",
    "send",
    "recv",
)


def count_collectives(
    rank, world_size, ckpt_dir, patched, device="cpu", tp=2, layout="tp_local", optimizer=True, impl="current"
):
    """Collectives issued by ``handle_gdn_in_state_dict`` (save preprocessing only), by name.

    ``impl``: "current" (what is bound now: the fix if applied) or "upstream" (the release's own).
    """
    from mcore_ckpt_fixes.engine.patching import original

    _cpu_cuda_shim()
    w = _World(tp)
    model, msd, osd, _ = _build(w, SAVE_SEED, layout, optimizer)
    fn = original(_MODULE, "handle_gdn_in_state_dict") if impl == "upstream" else _handle()
    dist.barrier()  # before the counters go in
    counts, depth = {}, []
    saved = {}
    for name in _COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue
        saved[name] = real

        def wrapper(*args, __name=name, __real=real, **kwargs):
            # Count what the caller issues, not the calls one collective makes internally
            # (all_gather_object runs an all_gather of sizes and one of payloads).
            if not depth:
                counts[__name] = counts.get(__name, 0) + 1
            depth.append(__name)
            try:
                return __real(*args, **kwargs)
            finally:
                depth.pop()

        setattr(dist, name, wrapper)
    try:
        import time

        error = None
        t0 = time.perf_counter()
        try:
            fn(model, msd, osd)
        except Exception as exc:  # 0.18 upstream on TP-local data: count up to the failure
            error = _short(exc)
        elapsed = time.perf_counter() - t0
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
    dist.barrier()
    n_params = len(_gdn_keys())
    n_tensors = n_params * (3 if optimizer else 1)
    return {
        "counts": counts,
        "total": sum(counts.values()),
        "gdn_params": n_params,
        "gdn_tensors": n_tensors,
        "seconds": elapsed,
        "impl": impl,
        "layout": layout,
        "tp": tp,
        "error": error,
    }


# -- plain torch DTensors (no Megatron-FSDP attributes) --------------------------------------------
#
# What a conversion script hands over when it distributes Hugging Face weights with torch's own
# DTensor API: parameters that are DTensors on a CPU DeviceMesh, with no ``megatron_fsdp_slice`` /
# ``megatron_fsdp_dist_index``. TP-local (the DTensor's global shape is this TP rank's tensor).
#
# (name, mesh shape, mesh dim names, placements, module TP). TP=1 layouts are built with
# ``distribute_tensor``; the TP=2 one with ``DTensor.from_local`` (its TP ranks hold different data,
# which ``distribute_tensor`` would overwrite with TP rank 0's), on a ("dp", "tp") mesh whose "tp"
# dimension tells each rank its TP rank.
PLAIN_LAYOUTS = {
    "shard0_1d": ((2,), ("dp",), ("S0",), 1),
    "replicate_1d": ((2,), ("dp",), ("R",), 1),
    "shard0_2d": ((1, 2), ("dp_replicate", "dp_shard"), ("R", "S0"), 1),
    "shard0_shard0_2d": ((2, 1), ("dp_outer", "dp_inner"), ("S0", "S0"), 1),
    "tp2_local_2d": ((1, 2), ("dp", "tp"), ("S0", "R"), 2),
}
PLAIN_TP1 = ("shard0_1d", "replicate_1d", "shard0_2d", "shard0_shard0_2d")


def _placements(codes):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if c == "S0" else Replicate() for c in codes]


def _plain_dtensor(full, mesh, placements, tp):
    """A plain torch DTensor of ``full`` (this TP rank's TP-local tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if tp == 1:
        return distribute_tensor(full, mesh, placements)
    # The TP ranks hold different tensors: place this rank's chunk of its own tensor by hand.
    local = full
    for i, p in enumerate(placements):
        if p.is_shard():
            local = torch.tensor_split(local, mesh.size(i), dim=p.dim)[mesh.get_local_rank(i)]
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False)


def _build_plain(layout, seed):
    """(model, model_state_dict, optimizer_state_dict, expected local parts by key, tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh_shape, names, codes, tp = PLAIN_LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp_rank = mesh.get_local_rank(names.index("tp")) if "tp" in names else 0
    placements = _placements(codes)
    gdn = GdnStandIn(tp)
    expected, state = {}, {}
    for name, shape in local_shapes(tp).items():
        if tp > 1 and name == "out_proj.weight":
            continue  # not a GDN fused tensor; a TP-local DTensor "replicated" over "tp" would collide by itself
        dt = _plain_dtensor(_values(seed, tp_rank, name, shape), mesh, placements, tp)
        getattr(gdn, name.split(".")[0]).register_parameter(
            name.split(".")[1], torch.nn.Parameter(dt, requires_grad=False)
        )
        key = f"{PATH}.{name}"
        expected[key] = dt.to_local().clone()
        entry = {"step": torch.tensor(7.0)}
        for sub in ("exp_avg", "exp_avg_sq"):
            entry[sub] = _plain_dtensor(_values(seed, tp_rank, f"{name}/{sub}", shape), mesh, placements, tp)
            expected[f"opt/{key}/{sub}"] = entry[sub].to_local().clone()
        state[f"module.module.{key}"] = entry
    model = _model_around(gdn)
    msd = {k: model.module.get_parameter(k) for k in expected if not k.startswith("opt/")}
    osd = {"state": state, "param_groups": [{"lr": 1.0, "params": list(state)}]}
    return model, msd, osd, {k: v.reshape(-1) for k, v in expected.items()}, tp


def plain_round_trip(rank, world_size, ckpt_dir, patched, device="cpu", layouts=PLAIN_TP1):
    """One world, one DCP round trip per layout (each into its own directory), model and Adam state."""
    import os

    if device != "cpu":
        raise ValueError("gdn-fsdp-split scenarios run on CPU (gloo) only")
    _cpu_cuda_shim()
    rt = _round_trip_result(device="cpu", layouts=list(layouts))
    rt.phase("setup")
    with rt.running():  # records DCP's CheckpointException too (a BaseException)
        rt.phase("precondition")
        rt["fix_state"] = _fix_state(patched)
        for layout in layouts:
            _plain_layout_round_trip(rt, layout, os.path.join(ckpt_dir, layout))
    return _finish(rt)


def _plain_layout_round_trip(rt, layout, path):
    """One layout of :func:`plain_round_trip`: save, load into a fresh model, compare, read back whole."""
    import types

    import torch.distributed.checkpoint as dcp

    rt.phase("setup")
    model, msd, osd, expected, tp = _build_plain(layout, SAVE_SEED)
    rt.phase("preprocess")
    msd_s, osd_s = _handle()(model, msd, osd)
    rt.phase("save")
    dcp.save(_dcp_state(msd_s, osd_s), checkpoint_id=path)
    dist.barrier()
    rt.phase("build_fresh")
    fmodel, fmsd, fosd, _, _ = _build_plain(layout, FRESH_SEED)
    rt.phase("load_preprocess")
    fstate = _dcp_state(*_handle()(fmodel, fmsd, fosd))
    rt.phase("load")
    dcp.load(fstate, checkpoint_id=path)
    rt.phase("compare")
    got, parts = _refuse(fstate["model"], fstate.get("optimizer"))
    # The fresh model's own tensors (what training goes on with) must hold the loaded values:
    # the pieces are views into them.
    for key in got:
        if not key.startswith("opt/"):
            got[key] = fmodel.module.get_parameter(key).to_local().reshape(-1)
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    rt.compare(expected, got, prefix=f"{layout}/", parts=parts)
    bad = rt.differing()
    assert not bad, f"tensors differ after load: {bad}"
    rt.phase("global_check")
    deltas = _global_check(types.SimpleNamespace(tp=tp), path)
    bad = {k: d for k, d in deltas.items() if d != 0.0}
    assert not bad, f"{layout}: saved components are not the TP-global ones: {bad}"
    dist.barrier()


def plain_dtensors(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=1, plain torch DTensors: Shard(0) on 1-D and 2-D meshes, nested Shard(0), Replicate."""
    return plain_round_trip(rank, world_size, ckpt_dir, patched, device, layouts=PLAIN_TP1)


def plain_dtensors_tp2(rank, world_size, ckpt_dir, patched, device="cpu"):
    """TP=2, TP-local plain torch DTensors on a ("dp", "tp") mesh."""
    return plain_round_trip(rank, world_size, ckpt_dir, patched, device, layouts=("tp2_local_2d",))
