"""rng-under-ep in verl's own checkpoint manager (``verl.utils.checkpoint.megatron_checkpoint_manager``).

verl (<= 0.9.1) does not call Megatron's ``get_rng_state``: ``MegatronCheckpointManager.get_rng_state``
is its own copy of it, with the same bug whatever Megatron-Core verl runs on:

* ``torch_dist`` (``extra/dist_ckpt/``): ``ShardedObject("rng_state", ..., (pp, tp), (pp_rank, tp_rank),
  replica_id=dp_cp_rank)``: one data-parallel rank per (pp, tp) writes, every rank restores its copy;
* Megatron-FSDP (``use_megatron_fsdp``): a plain ``{"(pp, tp)": [state]}`` entry in the DCP state dict,
  of which DCP keeps one copy per leaf, written by different ranks: every rank restores a mix.

Expert parallelism lives inside the data-parallel group, so every EP rank > 0 resumes on another
rank's streams, the tracker's ``expert-parallel-rng`` (MoE router noise, expert dropout) included.

The fix, class attributes of ``MegatronCheckpointManager`` and one binding of the manager's module:

* ``get_rng_state``: the release's object, laid out per rank: ``torch_dist``, global shape
  ``(pp, tp, dp_cp)``, offset ``(pp_rank, tp_rank, dp_cp_rank)``, ``replica_id=0`` (the layout of the
  Megatron-Core fix, so both read each other's checkpoints); Megatron-FSDP, this rank's own entry
  ``"(pp, tp, dp_cp)"`` beside the release's (kept, so an unfixed verl reads a fixed checkpoint);
* ``load_dist_checkpointing`` as the manager's module binds it (namespace-local: the model and
  optimizer loads pass through): asks for the RNG shard in the layout ``extra/dist_ckpt`` has
  (:func:`.old_layouts.align_rng_request`): the per-rank one, or the old 2-D one with a
  ``MegatronPatchWarning`` naming it;
* ``_load_megatron_fsdp_checkpoint``: reads the checkpoint's DCP metadata (which the load reads
  anyway) so that the RNG template asks for this rank's own entry only where the checkpoint has one
  (verl's loader allows partial loads: an entry it lacks would silently keep the template's value);
* ``load_rng_states``: Megatron-FSDP, restores this rank's own entry, or the shared copy with a
  ``MegatronPatchWarning`` (old layout, or a smaller data-parallel size at save).
"""

from __future__ import annotations

import contextvars
import dataclasses
import sys
import types

from ....dcp_metadata import install as share_metadata_reads, shared_metadata
from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import in_scope, module_scope
from .. import ID
from .fsdp_dtensor import drop_absent_own_entry, fsdp_dtensor_entry, restore_own_entry, with_per_rank_entry
from .old_layouts import align_rng_request
from .core import DelegatingNamespace, ProbeParallelState, torch_dist_verdict

MODULE = "verl.utils.checkpoint.megatron_checkpoint_manager"
CLASS = "MegatronCheckpointManager"

# The DCP metadata keys of the Megatron-FSDP checkpoint being loaded (None outside such a load).
_FSDP_LOAD_KEYS = contextvars.ContextVar("mcore_ckpt_fixes_rng_under_ep_verl_fsdp_load", default=None)


def _module():
    return sys.modules[MODULE]


def _dp_cp():
    """(rank, size) of this rank in the data-parallel x context-parallel group, as verl reads it."""
    mpu = _module().mpu
    return (
        mpu.get_data_parallel_rank(with_context_parallel=True),
        mpu.get_data_parallel_world_size(with_context_parallel=True),
    )


def _is_rng_object(obj) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(obj, ShardedObject) and obj.key.endswith("rng_state")


def _warn(text, stacklevel=3):
    import warnings

    from ....engine.errors import MegatronPatchWarning

    warnings.warn(text, MegatronPatchWarning, stacklevel=stacklevel)


# -- save side (and the load template, which verl builds with the same method) ------------------------


@layer(ID, MODULE, "get_rng_state", owner=CLASS)
def get_rng_state(below_us, self, *args, **kwargs):
    """``MegatronCheckpointManager.get_rng_state`` with every rank's RNG state its own."""
    state = below_us(self, *args, **kwargs)
    if fsdp_dtensor_entry(state) is not None:
        out = with_per_rank_entry(state, _dp_cp()[0])
        stored = _FSDP_LOAD_KEYS.get()
        if stored is not None:  # a load template: ask for our own entry only where it was saved
            holder = {"rng_state": out}
            drop_absent_own_entry(holder, stored)
        return out
    if not _is_rng_object(state) or len(state.global_shape) != 2:
        return state  # use_dist_ckpt=False: a plain list, left as verl writes it
    dp_cp_rank, dp_cp_size = _dp_cp()
    return dataclasses.replace(
        state,
        global_shape=(*state.global_shape, dp_cp_size),
        global_offset=(*state.global_offset, dp_cp_rank),
        replica_id=0,  # no other rank holds this state: this rank writes it
    )


# -- torch_dist load: extra/dist_ckpt ------------------------------------------------------------------


@layer(ID, MODULE, "load_dist_checkpointing")
def load_dist_checkpointing(below_us, sharded_state_dict, ckpt_dir, *args, **kwargs):
    """See :func:`_load_dist_checkpointing`; one ``.metadata`` read for its decision and the load together
    (:mod:`mcore_ckpt_fixes.dcp_metadata`)."""
    with shared_metadata():
        return _load_dist_checkpointing(below_us, sharded_state_dict, ckpt_dir, *args, **kwargs)


def _load_dist_checkpointing(func, sharded_state_dict, ckpt_dir, *args, **kwargs):
    """``load_dist_checkpointing`` (``func``, what lies below the layer) as verl's checkpoint manager
    calls it: the RNG shard requested in the layout the checkpoint has; every other load passes
    through unchanged."""
    template = sharded_state_dict.get("rng_state") if isinstance(sharded_state_dict, dict) else None
    if not _is_rng_object(template) or len(template.global_shape) != 3:
        return func(sharded_state_dict, ckpt_dir, *args, **kwargs)
    request, warning = align_rng_request(template, ckpt_dir)
    if warning is not None:
        _warn(warning)
    if request is template:
        return func(sharded_state_dict, ckpt_dir, *args, **kwargs)
    sharded_state_dict = dict(sharded_state_dict)  # the caller's dict stays as it built it
    if request is None:
        del sharded_state_dict["rng_state"]
    else:
        sharded_state_dict["rng_state"] = request
    # Every rank still calls the load (its collectives), with whatever is left to load.
    result = func(sharded_state_dict, ckpt_dir, *args, **kwargs)
    if request is None:
        # Nothing stored for this rank: restoring the states get_rng_state collected changes nothing.
        result["rng_state"] = template.data
    return result


# -- Megatron-FSDP load ---------------------------------------------------------------------------------


def _stored_keys(checkpoint_dir):
    """The DCP metadata keys of ``checkpoint_dir``, or None where it has none (the loader then
    raises its own error)."""
    import os

    if not os.path.isfile(os.path.join(str(checkpoint_dir), ".metadata")):
        return None
    try:
        from megatron.core.dist_checkpointing.strategies.torch import _get_filesystem_reader

        reader = _get_filesystem_reader(checkpoint_dir)
    except ImportError:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(str(checkpoint_dir))
    return set(reader.read_metadata().state_dict_metadata)


@layer(ID, MODULE, "_load_megatron_fsdp_checkpoint", owner=CLASS)
def load_megatron_fsdp_checkpoint(below_us, self, local_path, *args, **kwargs):
    """See :func:`_load_megatron_fsdp_checkpoint`; one ``.metadata`` read for its decision and the load together
    (:mod:`mcore_ckpt_fixes.dcp_metadata`)."""
    with shared_metadata():
        return _load_megatron_fsdp_checkpoint(below_us, self, local_path, *args, **kwargs)


def _load_megatron_fsdp_checkpoint(func, self, local_path, *args, **kwargs):
    """``MegatronCheckpointManager._load_megatron_fsdp_checkpoint`` (``func``, what lies below the
    layer), its RNG template built knowing which entries the checkpoint holds."""
    stored = _stored_keys(_module().get_model_dist_checkpoint_path(local_path))
    token = _FSDP_LOAD_KEYS.set(stored)
    try:
        return func(self, local_path, *args, **kwargs)
    finally:
        _FSDP_LOAD_KEYS.reset(token)


@layer(ID, MODULE, "load_rng_states", owner=CLASS)
def load_rng_states(below_us, self, rng_states, *args, **kwargs):
    """``MegatronCheckpointManager.load_rng_states``: Megatron-FSDP restores this rank's own entry."""
    if getattr(self, "use_megatron_fsdp", False) and fsdp_dtensor_entry(rng_states) is not None:
        pp, tp = fsdp_dtensor_entry(rng_states)
        own = f"({pp}, {tp}, {_dp_cp()[0]})"
        stored = _FSDP_LOAD_KEYS.get()
        if own not in rng_states and stored is not None and _holds(stored, own):
            # Saved with this rank's own entry, which Megatron-Bridge's loader (with this fix's
            # Megatron-Bridge target applied) already handed back under "(pp, tp)".
            return below_us(self, rng_states, *args, **kwargs)
        holder = {"rng_state": dict(rng_states)}
        warning = restore_own_entry({f"({pp}, {tp})": None, own: None}, holder)
        if warning is not None:
            _warn(warning, stacklevel=4)  # the caller's line, past @layer's frame
        rng_states = holder["rng_state"]
    return below_us(self, rng_states, *args, **kwargs)


def _holds(stored_keys, entry):
    prefix = f"rng_state.{entry}"
    return any(k == prefix or k.startswith(prefix + ".") for k in stored_keys)


# -- probe: verl's own get_rng_state on stand-ins ------------------------------------------------------


class _VerlProbeMpu(ProbeParallelState):
    """``parallel_state`` as rank ``dp_rank`` of pp=1, tp=1, dp_cp=2 sees it (nothing initialised)."""

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_world_size(self):
        return 1


def _probe_once(module, cls, dp_rank, use_megatron_fsdp=False):
    tracker = types.SimpleNamespace(get_states=lambda: {})
    stand_ins = {
        "mpu": _VerlProbeMpu(dp_rank),
        # Megatron's global tracker and the accelerator are not touched.
        "tensor_parallel": DelegatingNamespace(module.tensor_parallel, get_cuda_rng_tracker=lambda *a, **k: tracker),
        "is_device_available": lambda: False,
    }
    saved = {name: module.__dict__[name] for name in stand_ins if name in module.__dict__}
    missing = sorted(set(stand_ins) - set(saved))
    if missing:
        raise RuntimeError(f"{MODULE} no longer defines {', '.join(missing)}")
    manager = object.__new__(cls)  # only get_rng_state's attribute: no model, optimizer or config
    manager.use_megatron_fsdp = use_megatron_fsdp
    # In a copy of the module's globals with the stand-ins: the live module is left as it is.
    scope = module_scope(module, **stand_ins)
    return in_scope(original(cls, "get_rng_state"), scope)(manager, use_dist_ckpt=True)


def probe(module: types.ModuleType):
    cls = getattr(module, CLASS, None)
    needed = ("get_rng_state", "load_rng_states", "_load_megatron_fsdp_checkpoint")
    if cls is None or not all(hasattr(cls, n) for n in needed) or not hasattr(module, "load_dist_checkpointing"):
        return None, f"{MODULE} has no {CLASS}.get_rng_state / load_rng_states / load_dist_checkpointing"
    verdict, why = torch_dist_verdict(
        _probe_once(module, cls, 0),
        _probe_once(module, cls, 1),
        f"verl's {CLASS}.get_rng_state",
        f"{CLASS}.get_rng_state(use_dist_ckpt=True)",
    )
    return verdict, (f"{why} (its Megatron-FSDP entry is keyed by (pp, tp) too)" if verdict else why)


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    share_metadata_reads(patcher)  # the load side reads the metadata: shared with the load's own read
    cls = getattr(module, CLASS)
    patcher.replace(cls, "get_rng_state", get_rng_state)
    patcher.replace(cls, "load_rng_states", load_rng_states)
    patcher.replace(cls, "_load_megatron_fsdp_checkpoint", load_megatron_fsdp_checkpoint)
    # Namespace-local: only the manager's own loads go through it (model and optimizer untouched).
    patcher.replace(module, "load_dist_checkpointing", load_dist_checkpointing)
