"""rng-under-ep round trips through verl's own ``MegatronCheckpointManager`` (verl 0.9.1).

Worlds of 2 (TP=PP=1, EP=2: the two EP ranks are the two data-parallel ranks) or 4 ranks (EP=2 x
DP=2 over a data-parallel group of 4) on CPU with gloo. Each rank builds a real
``MegatronCheckpointManager`` with ``save_contents = load_contents = ["extra"]`` (the RNG state is
all that goes into the checkpoint) and calls verl's own ``save_checkpoint`` / ``load_checkpoint``:

* ``torch_dist``: ``_build_extra_state_dict`` -> ``get_rng_state`` -> ``save_dist_checkpointing`` into
  ``<ckpt>/extra/dist_ckpt``; the load builds the same template and calls verl's
  ``load_dist_checkpointing`` on that directory, then ``load_rng_states``.
* Megatron-FSDP (``use_megatron_fsdp=True``): ``_save_megatron_fsdp_checkpoint`` /
  ``_load_megatron_fsdp_checkpoint`` into ``<ckpt>/model/dist_ckpt``, then ``load_rng_states``.

RNG states per rank, as a run has them after some steps: verl's seeding (``set_random_seed`` in
``verl/workers/engine/megatron/utils.py``: Python, NumPy, torch from one seed, then Megatron's
``model_parallel_cuda_manual_seed``, whose expert-parallel stream is seeded per EP rank), then a
rank-dependent number of draws from every generator and every tracker stream. Every component
verl checkpoints then differs between the ranks: Python ``random``, NumPy, torch CPU and the three
tracker streams (the accelerator's own generator is saved by verl only where a device is available:
not on a CPU host).

Stand-ins (these workers only, never ``import mcore_ckpt_fixes``):

* :class:`.core.CudaRngStandIn`: one CPU generator plays the CUDA default generator, so that
  Megatron's RNG tracker holds a distinct state per stream (see core.py);
* what verl's constructor and save need and this round trip does not exercise: ``config`` with
  ``model.path``, a ``transformer_config`` namespace (rank 0 dumps it to JSON), no HF bridge (none is
  needed with ``["extra"]``);
* Megatron-FSDP only: ``megatron.bridge.training.checkpointing`` (verl imports its
  ``save_fsdp_dtensor_checkpoint`` / ``load_fsdp_dtensor_checkpoint``) is a stand-in doing what
  Megatron-Bridge 0.6.2 does with the state dict: ``torch.distributed.checkpoint.save`` with a
  ``FileSystemWriter``, and ``load`` with ``DefaultLoadPlanner(allow_partial_load=not
  strict_fsdp_dtensor_load)``, ``_model`` popped first. Bridge's model preprocessing (SWiGLU, experts,
  uneven DTensors) is left out: it touches ``model`` / ``optimizer`` only and needs a model wrapped in
  Megatron-FSDP, whose CUDA buffers a CPU host cannot build. The model is a module whose
  ``state_dict_for_save_checkpoint`` is empty and the optimizer one whose ``sharded_state_dict`` is
  empty (verl's FSDP load builds both templates even when it loads only ``extra``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import types
import warnings

import numpy as np
import torch
import torch.distributed as dist

from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID as FIX_ID
from .core import CudaRngStandIn, consume_streams, deltas

MODULE = "verl.utils.checkpoint.megatron_checkpoint_manager"
EP = 2
SEED, FRESH_SEED = 1234, 4321


def prepare() -> None:
    """Run in the parent before any world starts: import what the ranks use, once."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import omegaconf  # noqa: F401

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import verl.utils.checkpoint.megatron_checkpoint_manager  # noqa: F401


# -- Megatron-Bridge stand-in (Megatron-FSDP worlds only) -------------------------------------------


def _bridge_stand_in():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    def save_fsdp_dtensor_checkpoint(checkpoint_path, state_dict, *, cfg, model, storage_writer=None, barrier=True):
        writer = storage_writer if storage_writer is not None else dcp.FileSystemWriter(str(checkpoint_path))
        result = dcp.save(state_dict=state_dict, storage_writer=writer)
        if barrier and dist.is_initialized():
            dist.barrier()
        return result

    def load_fsdp_dtensor_checkpoint(
        load_dir,
        ckpt_cfg,
        rank0,
        sharded_state_dict,
        iteration,
        release=False,
        checkpoint_path_override=None,
        checkpointing_context=None,
        cfg=None,
    ):
        name = checkpoint_path_override if checkpoint_path_override is not None else load_dir
        if rank0:
            return {}, name, release, "fsdp_dtensor"
        state_dict = sharded_state_dict
        state_dict.pop("_model")
        allow_partial_load = not getattr(ckpt_cfg, "strict_fsdp_dtensor_load", False)
        planner = DefaultLoadPlanner(allow_partial_load=allow_partial_load)
        dcp.load(state_dict=state_dict, storage_reader=dcp.FileSystemReader(str(name)), planner=planner)
        return state_dict, name, release, "fsdp_dtensor"

    module = types.ModuleType("megatron.bridge.training.checkpointing")
    module.__doc__ = "mcore_ckpt_fixes test stand-in (checks/verl.py): DCP save/load as Megatron-Bridge 0.6.2"
    module.save_fsdp_dtensor_checkpoint = save_fsdp_dtensor_checkpoint
    module.load_fsdp_dtensor_checkpoint = load_fsdp_dtensor_checkpoint
    return module


@contextlib.contextmanager
def _bridge_registered(use_megatron_fsdp):
    names = ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.training.checkpointing")
    if not use_megatron_fsdp:
        yield
        return
    saved = {n: sys.modules.get(n) for n in names}
    leaf = _bridge_stand_in()
    sys.modules[names[0]] = types.ModuleType(names[0])
    sys.modules[names[1]] = types.ModuleType(names[1])
    sys.modules[names[2]] = leaf
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


class _FsdpModelStandIn(torch.nn.Module):
    def state_dict_for_save_checkpoint(self):
        return {}


class _OptimizerStandIn:
    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        return {}


# -- setup ----------------------------------------------------------------------------------------


def _setup(use_megatron_fsdp):
    """Parallel state (TP=PP=1, EP=2 over the whole world) and a real MegatronCheckpointManager."""
    from megatron.core import parallel_state as mpu
    from omegaconf import OmegaConf

    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=EP
    )
    assert mpu.get_expert_model_parallel_world_size() == EP
    assert mpu.get_data_parallel_world_size(with_context_parallel=True) == dist.get_world_size()
    contents = ["extra"]
    manager = MegatronCheckpointManager(
        config=OmegaConf.create({"model": {"path": "unused-by-this-round-trip"}}),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents, "async_save": False}),
        model_config=None,
        transformer_config=types.SimpleNamespace(
            num_layers=1, hidden_size=16, num_moe_experts=EP, expert_model_parallel_size=EP
        ),
        role="actor",
        model=torch.nn.ModuleList([_FsdpModelStandIn()]),
        arch="RngUnderEpRoundTrip",
        hf_config=None,
        param_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
        processing_class=None,
        optimizer=_OptimizerStandIn(),
        optimizer_scheduler=None,
        use_distributed_optimizer=False,
        use_dist_checkpointing=False,
        use_megatron_fsdp=use_megatron_fsdp,
    )
    return manager


def _seed_and_consume(stand_in, seed):
    """verl's set_random_seed (the tracker seeded as on an accelerator), then rank-dependent draws."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    consume_streams(stand_in, seed)


def snapshot():
    """Every RNG state verl checkpoints on this host, as this rank has it now (copies)."""
    from megatron.core import tensor_parallel

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state().clone()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        state = state.get_state() if isinstance(state, torch.Generator) else state
        states[f"tracker:{name}"] = state.clone()
    return states


def _layout(manager):
    obj = manager.get_rng_state()
    if isinstance(obj, dict):
        return sorted(obj)
    return list(obj.global_shape), list(obj.global_offset), obj.replica_id


def _round_trip():
    rt = RoundTrip(device="cpu", saved=None, loaded=None, before=None, warnings=[], layout=None)
    rt.phase("setup")
    return rt


def _save(manager, ckpt_dir, stand_in, rt, patched):
    _seed_and_consume(stand_in, SEED)
    rt.phase("precondition")
    rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
    rt["layout"] = _layout(manager)
    rt.phase("save")
    saved = snapshot()
    manager.save_checkpoint(str(ckpt_dir), global_step=1)
    dist.barrier()
    return saved


def _load(manager, ckpt_dir, stand_in, rt):
    rt.phase("perturb")
    _seed_and_consume(stand_in, FRESH_SEED)  # other states than the saved ones, on every rank
    before = snapshot()
    rt.phase("load")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manager.load_checkpoint(str(ckpt_dir))
    rt["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "RNG state" in str(w.message)]
    return before, snapshot()


def _teardown():
    from megatron.core import parallel_state as mpu

    with contextlib.suppress(Exception):
        mpu.destroy_model_parallel()


# -- scenarios --------------------------------------------------------------------------------------


def round_trip(rank, world_size, ckpt_dir, patched, use_megatron_fsdp=False):
    """save_checkpoint, new RNG states everywhere, load_checkpoint: every rank's RNG states must be
    what it saved. ``max_delta``: per RNG component."""
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, _bridge_registered(use_megatron_fsdp), rt.running():
        manager = _setup(use_megatron_fsdp)
        saved = _save(manager, ckpt_dir, stand_in, rt, patched)
        rt["before"], loaded = _load(manager, ckpt_dir, stand_in, rt)
        rt.phase("compare")
        rt["saved"], rt["loaded"] = saved, loaded
        rt["n_tensors"] = len(saved)
        rt["max_delta"] = deltas(saved, loaded)
        bad = {k: d for k, d in rt["max_delta"].items() if d != 0.0}
        assert not bad, f"RNG states differ after load: {sorted(bad)}"
    _teardown()
    return rt.result


def save_only(rank, world_size, ckpt_dir, patched, use_megatron_fsdp=False):
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, _bridge_registered(use_megatron_fsdp), rt.running():
        manager = _setup(use_megatron_fsdp)
        rt["saved"] = _save(manager, ckpt_dir, stand_in, rt, patched)
        rt["n_tensors"] = len(rt["saved"])
    _teardown()
    return rt.result


def load_only(rank, world_size, ckpt_dir, patched, use_megatron_fsdp=False):
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, _bridge_registered(use_megatron_fsdp), rt.running():
        manager = _setup(use_megatron_fsdp)
        rt.phase("precondition")
        rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
        rt["before"], rt["loaded"] = _load(manager, ckpt_dir, stand_in, rt)
        rt["n_tensors"] = len(rt["loaded"])
    _teardown()
    return rt.result
