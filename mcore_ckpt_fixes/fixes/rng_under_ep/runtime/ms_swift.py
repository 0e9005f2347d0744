"""rng-under-ep in ms-swift (``swift.megatron.utils.megatron_lm_utils``), which keeps its own copy of
Megatron-LM's RNG checkpointing: the monkeypatch, its probe and apply. Imported only when that
module is.

The bug there (ms-swift <= 4.6.0):

* ``torch_dist``: ``_get_rng_state`` describes the RNG state as ``ShardedObject('rng_state', ...,
  (pp_size, tp_size), (pp_rank, tp_rank), replica_id=dp_cp_rank)``, so one data-parallel rank per
  (pp, tp) writes and ``load_mcore_checkpoint`` hands its copy to all of them: every EP rank > 0
  resumes on another rank's streams (the expert-parallel tracker stream ``expert-parallel-rng``
  included);
* ``fsdp_dtensor`` (``--use_megatron_fsdp``): ``megatron_fsdp_checkpoint.build_rng_state`` keys the
  plain entry ``"(pp, tp)"`` and DCP keeps one copy of each of its leaves, written by different
  ranks: every rank of a (pp, tp) resumes on a mix.

The fix, through ms-swift's own functions (the same layouts as the megatron.training fix, so a
checkpoint moves between the two):

* save: ``_get_rng_state`` (wrapped) returns the per-rank layout: torch_dist, global shape
  ``(pp, tp, dp_cp)``, offset ``(pp_rank, tp_rank, dp_cp_rank)``, ``replica_id=0``; fsdp_dtensor,
  an extra entry ``"(pp, tp, dp_cp)"`` beside the release's (:mod:`.fsdp_dtensor`);
* load, torch_dist: ``load_mcore_checkpoint`` calls ``dist_checkpointing.load`` through its module's
  name ``dist_checkpointing``; that name (in this module only) becomes :data:`DIST_CHECKPOINTING`,
  the same package except that ``load`` asks for the RNG shard in the layout the checkpoint has
  (:func:`.old_layouts.align_rng_request`): the old 2-D layout with a ``MegatronPatchWarning``
  naming it, never silently;
* load, fsdp_dtensor: the DCP planner of ``megatron_fsdp_checkpoint`` (its ``default_planner``
  name) leaves this rank's own entry out where the checkpoint has none, and ``select_rng_state``
  (wrapped) restores this rank's own entry, or the shared copy with a ``MegatronPatchWarning``.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import warnings

from ....dcp_metadata import install as share_metadata_reads, shared_metadata
from ....engine.layers import layer
from ....engine.patching import Patcher, mark, original
from ....engine.probing import in_scope, module_scope
from .. import ID
from . import fsdp_dtensor
from .fsdp_dtensor import fsdp_dtensor_entry, restore_own_entry, with_per_rank_entry
from .old_layouts import align_rng_request
from .core import DelegatingNamespace, ProbeParallelState, is_rng_object, torch_dist_verdict

MODULE = "swift.megatron.utils.megatron_lm_utils"
FSDP_MODULE = "swift.megatron.utils.megatron_fsdp_checkpoint"


def _warn(text, stacklevel=3):
    from ....engine.errors import MegatronPatchWarning

    warnings.warn(text, MegatronPatchWarning, stacklevel=stacklevel)


def _mpu():
    return sys.modules[MODULE].mpu  # megatron.core.mpu, as ms-swift binds it


# -- save side ---------------------------------------------------------------------------------------


@layer(ID, MODULE, "_get_rng_state")
def get_rng_state(below_us, *args, **kwargs):
    """``megatron_lm_utils._get_rng_state`` with every rank's RNG state its own: torch_dist, a
    per-rank ShardedObject; fsdp_dtensor, a per-rank entry beside the release's."""
    state = below_us(*args, **kwargs)
    mpu = _mpu()
    if fsdp_dtensor_entry(state) is not None:
        return with_per_rank_entry(state, mpu.get_data_parallel_rank(with_context_parallel=True))
    if not is_rng_object(state) or len(state.global_shape) != 2:
        return state
    return dataclasses.replace(
        state,
        global_shape=(*state.global_shape, mpu.get_data_parallel_world_size(with_context_parallel=True)),
        global_offset=(*state.global_offset, mpu.get_data_parallel_rank(with_context_parallel=True)),
        replica_id=0,  # no other rank holds this state: it must be written by this rank
    )


# -- load side, torch_dist ---------------------------------------------------------------------------


@mark(ID)
def dist_checkpointing_load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
    """See :func:`_dist_checkpointing_load`; one ``.metadata`` read for its decision and the load together
    (:mod:`mcore_ckpt_fixes.dcp_metadata`)."""
    with shared_metadata():
        return _dist_checkpointing_load(sharded_state_dict, checkpoint_dir, *args, **kwargs)


def _dist_checkpointing_load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
    """``megatron.core.dist_checkpointing.load`` as ``load_mcore_checkpoint`` calls it, asking for
    the RNG shard in the layout the checkpoint has."""
    from megatron.core import dist_checkpointing

    template = sharded_state_dict.get("rng_state") if isinstance(sharded_state_dict, dict) else None
    if template is None or not is_rng_object(template) or len(template.global_shape) != 3:
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, *args, **kwargs)
    request, warning = align_rng_request(template, checkpoint_dir)
    if warning is not None:
        _warn(warning)
    if request is not template:
        sharded_state_dict = dict(sharded_state_dict)  # the caller's dict stays as it built it
        if request is None:
            # Nothing stored for this rank: load_mcore_checkpoint restores the RNG state only when
            # the loaded dict has one, so this rank keeps its current state.
            del sharded_state_dict["rng_state"]
        else:
            sharded_state_dict["rng_state"] = request
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, *args, **kwargs)


class DistCheckpointingModule:
    """``megatron.core.dist_checkpointing`` as ``swift.megatron.utils.megatron_lm_utils`` sees it with
    the fix: the same package, except that ``load`` is :func:`dist_checkpointing_load`. Bound in that
    module's namespace only; every other user of the package is untouched."""

    def __init__(self):
        self.__qualname__ = "DIST_CHECKPOINTING"  # what it is named by, for reports of what a fix changed

    def __getattr__(self, name):
        if name == "load":
            return dist_checkpointing_load
        import megatron.core.dist_checkpointing as real

        return getattr(real, name)

    def __reduce__(self):
        return "DIST_CHECKPOINTING"  # pickled by reference, as the module global it is

    def __repr__(self):
        return f"<megatron.core.dist_checkpointing as {MODULE} sees it (mcore_ckpt_fixes: {ID})>"


# Defined here, where its class is, so that revert leaves this definition alone while it restores
# every binding of it (as fsdp_dtensor.DEFAULT_PLANNER).
DIST_CHECKPOINTING = mark(ID)(DistCheckpointingModule())


# -- load side, fsdp_dtensor -------------------------------------------------------------------------


@layer(ID, FSDP_MODULE, "select_rng_state")
def select_rng_state(below_us, rng_state, *args, **kwargs):
    """``megatron_fsdp_checkpoint.select_rng_state``: this rank's own ``(pp, tp, dp_cp)`` entry where
    the checkpoint has it, else the release's shared ``(pp, tp)`` copy with a warning."""
    if fsdp_dtensor_entry(rng_state) is None:
        return below_us(rng_state, *args, **kwargs)
    mpu = sys.modules[FSDP_MODULE].mpu
    pp, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    dp_cp = mpu.get_data_parallel_rank(with_context_parallel=True)
    # What get_rng_state asked for (restore_own_entry reads the keys only).
    request = {f"({pp}, {tp})": None, f"({pp}, {tp}, {dp_cp})": None}
    holder = {"rng_state": rng_state}
    warning = restore_own_entry(request, holder)
    if warning is not None:
        _warn(warning, stacklevel=4)  # the caller's line, past @layer's frame
    return below_us(holder["rng_state"], *args, **kwargs)


# -- probe: run ms-swift's own _get_rng_state on stand-ins for what it reads --------------------------


class _SwiftProbeMpu(ProbeParallelState):
    """``megatron.core.mpu`` as one rank of pp=1, tp=1, dp_cp=2 sees it (ms-swift also reads the sizes)."""

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_world_size(self):
        return 1


def _probe_once(module, dp_rank):
    import torch

    fake_cuda = DelegatingNamespace(torch.cuda, get_rng_state=lambda device="cuda": torch.zeros(8, dtype=torch.uint8))
    fake_dist = DelegatingNamespace(torch.distributed, is_initialized=lambda: False)
    tracker = types.SimpleNamespace(get_states=lambda: {})
    stand_ins = {
        "mpu": _SwiftProbeMpu(dp_rank),
        # No CUDA generator or global RNG tracker is touched (why: :func:`.core._probe_once`).
        "torch": DelegatingNamespace(torch, cuda=fake_cuda, distributed=fake_dist),
        "tensor_parallel": DelegatingNamespace(module.tensor_parallel, get_cuda_rng_tracker=lambda *a, **k: tracker),
    }
    saved = {name: module.__dict__[name] for name in stand_ins if name in module.__dict__}
    missing = sorted(set(stand_ins) - set(saved))
    if missing:
        raise RuntimeError(f"{MODULE} no longer defines {', '.join(missing)}")
    # In a copy of the module's globals with the stand-ins: the live module is left as it is.
    scope = module_scope(module, **stand_ins)
    return in_scope(original(module, "_get_rng_state"), scope)(fsdp_dtensor=False, data_parallel_random_init=False)


def probe(module: types.ModuleType):
    if not hasattr(module, "_get_rng_state") or not hasattr(module, "dist_checkpointing"):
        return None, f"{MODULE} has no _get_rng_state / dist_checkpointing"
    return torch_dist_verdict(
        _probe_once(module, 0),
        _probe_once(module, 1),
        "ms-swift's _get_rng_state",
        "ms-swift's _get_rng_state(fsdp_dtensor=False)",
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    share_metadata_reads(patcher)  # the load side reads the metadata: shared with the load's own read
    patcher.replace_function(module, "_get_rng_state", get_rng_state)
    # Namespace-local: only load_mcore_checkpoint (and save_mcore_checkpoint, unchanged) use it.
    patcher.replace(module, "dist_checkpointing", DIST_CHECKPOINTING)
    fsdp = sys.modules.get(FSDP_MODULE)
    if fsdp is not None and hasattr(fsdp, "select_rng_state"):
        patcher.replace_function(fsdp, "select_rng_state", select_rng_state)
        if hasattr(fsdp, "default_planner"):
            # Namespace-local too: only megatron_fsdp_checkpoint.load_checkpoint plans through it.
            patcher.replace(fsdp, "default_planner", fsdp_dtensor.DEFAULT_PLANNER)
