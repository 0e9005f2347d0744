"""hsdp-ep-guard: Megatron-FSDP's mesh set-up for three parallel configurations on 4 ranks, and a
DCP round trip of a dense and an expert parameter on the meshes each one gets.

Configurations, in this order (each with ``parallel_state.initialize_model_parallel``):

* ``ep2``: EP=2, one distributed-optimizer instance (accepted everywhere);
* ``hsdp``: EP=1, ``num_distributed_optimizer_instances=2`` (HSDP; accepted everywhere);
* ``hsdp_ep2``: EP=2 and HSDP. 0.16 builds no expert mesh: the scenario finds the expert
  parameters placed on the dense data-parallel mesh (the documented bug, reported as an
  ``AssertionError`` in phase ``placement``); with the guard, set-up refuses with
  :func:`mcore_ckpt_fixes.fixes.hsdp_ep_guard.runtime.core.refusal` (exactly that line: the expected outcome, not
  an error); 0.17+ builds an expert mesh and the round trip runs.

What is real: ``parallel_state``, ``FullyShardedDataParallel._init_dist_index`` (the first step of
``FullyShardedDataParallel.__init__``, where the guard sits and where the meshes are chosen),
``make_fsdp_dtensor`` with uneven chunk metadata, torch DCP. Not run: the rest of ``__init__``
(``MegatronFSDP`` allocates CUDA buffers); the meshes are created on the CPU (see
``testing.meshes.cpu_device_meshes``, installed in the worker only).

The "tensors" of the result are the dense and expert parameter of every configuration that was set
up; a refused configuration contributes none and is listed under ``refused``.
"""

from __future__ import annotations

import os
import types
import zlib

import torch
import torch.distributed as dist

from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID as FIX_ID
from .. import MODULE as _MODULE
from .scenarios import DENSE_MESH
from ..runtime.core import refusal

SAVE_SEED, FRESH_SEED = 1234, 98765
NUM_EXPERTS, ROWS, COLS = 4, 6, 3
CONFIGS = (("ep2", 2, 1), ("hsdp", 1, 2), ("hsdp_ep2", 2, 2))  # name, EP, optimizer instances


def prepare() -> None:
    import torch.distributed.checkpoint  # noqa: F401

    import megatron.core.distributed.fsdp.mcore_fsdp_adapter  # noqa: F401


def _fix_state(patched):
    return fix_states(FIX_ID, (_MODULE,), patched)


def _values(seed, what, ep_rank):
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{what}/{ep_rank}".encode()))
    return torch.randn((ROWS, COLS), generator=g, dtype=torch.float32)


def _ranks(mesh):
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


def _setup(ep, instances):
    """(dist index, expert-DP ranks, dense-DP ranks, ep rank) from the real mesh construction."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from ....testing.meshes import cpu_device_meshes

    ps.initialize_model_parallel(expert_model_parallel_size=ep, num_distributed_optimizer_instances=instances)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        num_distributed_optimizer_instances=instances,
    )
    wrapper = types.SimpleNamespace(ddp_config=ddp_config, num_moe_experts=NUM_EXPERTS)
    edp = sorted(dist.get_process_group_ranks(ps.get_expert_data_parallel_group()))
    dp = sorted(dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)))
    with cpu_device_meshes():
        index = FullyShardedDataParallel._init_dist_index(wrapper, None)
    return index, edp, dp, ps.get_expert_model_parallel_rank()


def _param(index, full, is_expert):
    """This rank's FSDP shard (uneven cut over the mesh's dp_cp dimension) as Megatron-FSDP's DTensor."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    mesh = index.expt_device_mesh if is_expert else index.device_mesh
    size, rank = mesh.size(mesh.mesh_dim_names.index("dp_cp")), mesh.get_local_rank("dp_cp")
    bounds = [min(ROWS, -(-ROWS * k * 5 // (4 * size))) for k in range(size)] + [ROWS]
    shard = full[bounds[rank] : bounds[rank + 1]].clone()
    template = torch.nn.Parameter(torch.empty(full.shape), requires_grad=False)
    dt = make_fsdp_dtensor(
        shard, template, index, is_sharded_param=True, is_expert_param=is_expert, update_uneven_dtensor_chunk_meta=True
    )
    return dt, shard


def _round_trip(name, index, ep_rank, ckpt_dir):
    """Save this configuration's dense and expert parameter with DCP, load them into fresh ones:
    (what each rank saved, what it loaded back), keyed ``<config>/dense`` and ``<config>/expert``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def build(seed):
        dense, d_shard = _param(index, _values(seed, "dense", 0), False)
        expert, e_shard = _param(index, _values(seed, "expert", ep_rank), True)
        key = f"layers.0.mlp.experts.linear_fc1.weight{ep_rank}"  # a global expert index per EP rank
        return {"dense": dense, key: expert}, {f"{name}/dense": d_shard, f"{name}/expert": e_shard}, key

    state, expected, key = build(SAVE_SEED)
    path = os.path.join(ckpt_dir, name)
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    fresh, _, _ = build(FRESH_SEED)
    dcp.load(fresh, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=False))
    return expected, {f"{name}/dense": fresh["dense"].to_local(), f"{name}/expert": fresh[key].to_local()}


def _configuration(rt, name, ep, instances, ckpt_dir):
    """Set up one configuration's meshes, check where its parameters are placed and round-trip them;
    a set-up refused with exactly the guard's line is recorded under ``refused`` (the expected
    outcome of HSDP x EP with the guard), any other refusal is a failure."""
    from megatron.core import parallel_state as ps

    rt.phase(f"setup:{name}")
    try:
        index, edp, dp, ep_rank = _setup(ep, instances)
    except ValueError as exc:
        if str(exc) != refusal(instances, ep) or ep == 1 or instances == 1:
            raise
        rt["refused"][name] = str(exc)
        ps.destroy_model_parallel()
        return
    rt.phase("placement")
    meshes = {
        "dense": _ranks(index.device_mesh),
        "expert": _ranks(index.expt_device_mesh),
        "dense_dp_group": dp,
        "expert_dp_group": edp,
    }
    rt["meshes"][name] = meshes
    assert meshes["dense"] == dp, f"{name}: dense parameters are not sharded over the data-parallel ranks: {meshes}"
    assert meshes["expert"] == edp, f"{name}: {DENSE_MESH}"
    rt.phase(f"round_trip:{name}")
    rt.compare(*_round_trip(name, index, ep_rank, ckpt_dir))
    ps.destroy_model_parallel()


def configurations(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import parallel_state as ps

    if device != "cpu":
        raise ValueError("hsdp-ep-guard scenarios run on CPU (gloo) only")
    assert world_size == 4, f"hsdp-ep-guard needs 4 ranks (HSDP x EP=2), got {world_size}"
    rt = RoundTrip(device="cpu", refused={}, meshes={})
    try:
        with rt.running():  # records DCP's CheckpointException too (a BaseException)
            rt.phase("precondition")
            rt["fix_state"] = _fix_state(patched)
            for name, ep, instances in CONFIGS:
                _configuration(rt, name, ep, instances, ckpt_dir)
            rt.phase("compare")
            bad = rt.differing()
            assert not bad, f"tensors differ after load: {bad}"
    finally:
        ps.destroy_model_parallel()
    return rt.result


def expert_meshes_exist():
    """None where Megatron-FSDP builds expert meshes (0.16+: ``FSDPDistributedIndex(expt_device_mesh=...)``),
    else why the scenario cannot run here."""
    import inspect

    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    if "expt_device_mesh" in inspect.signature(FSDPDistributedIndex.__init__).parameters:
        return None
    return "Megatron-FSDP has no expert device mesh in this release (FSDPDistributedIndex takes no expt_device_mesh)"
