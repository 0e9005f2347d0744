"""rng-under-ep in Megatron-Bridge's own checkpointing (``megatron.bridge.training.checkpointing``).

Bridge keeps its own copy of ``get_rng_state`` and of the RNG restore in ``load_checkpoint``:

* ``torch_dist``: already per rank under expert parallelism in 0.6.2 (EP > 1: ``ShardedObject``
  of global shape ``(pp, tp, dp_cp)``, ``replica_id=0``, the layout of upstream Megatron-LM's fix;
  without EP the data-parallel ranks hold the same RNG streams and ``(pp, tp)`` with
  ``replica_id=dp_cp`` is exact). Left alone.
* ``fsdp_dtensor``: the plain entry ``{"(pp, tp)": [state]}`` (checkpointing.py:536-539), the same
  entry for every data-parallel rank of a (pp, tp): DCP keeps one copy of each leaf, written by
  different ranks, so every EP rank resumes on a mix of the ranks' states (the expert-parallel
  tracker stream of another EP rank included).

The fix is :mod:`.fsdp_dtensor`'s, on Bridge's functions:

* save: ``get_rng_state`` (wrapped) adds this rank's own entry ``"(pp, tp, dp_cp)"`` beside the
  release's (kept: an unfixed Bridge reads a fixed checkpoint as its own).
* load: ``load_fsdp_dtensor_checkpoint`` (wrapped) gets the request with both entries. Bridge builds
  its DCP planner inline (``torch.distributed.checkpoint.default_planner.DefaultLoadPlanner(...)``,
  no module-level binding to swap namespace-locally as in Megatron-LM), so the wrapper reads the
  checkpoint's DCP metadata itself (the ``.metadata`` file the load reads anyway, never tensor data;
  Bridge's own non-strict load reads it too) and leaves this rank's entry out of the request where
  the checkpoint has none (also needed in Bridge's default non-strict mode, where DCP would skip the
  missing key and the request's current state would pass for the restored one). After the load it
  hands ``load_checkpoint`` this rank's own entry under the ``"(pp, tp)"`` key it reads, or, for an
  old-layout checkpoint, leaves the shared copy there with a ``MegatronPatchWarning`` naming the
  old layout.
"""

from __future__ import annotations

import sys
import types

from ....dcp_metadata import install as share_metadata_reads, shared_metadata
from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import Group, in_scope, module_scope
from .. import ID
from .fsdp_dtensor import (
    drop_absent_own_entry,
    fsdp_dtensor_entry,
    own_entry_key,
    restore_own_entry,
    with_per_rank_entry,
)
from .core import DelegatingNamespace, bind_arguments

MODULE = "megatron.bridge.training.checkpointing"


def _dp_cp_rank(func, args, kwargs):
    """This rank's index in ``pg_collection.dp_cp``, as Bridge reads it for the torch_dist layout."""
    return bind_arguments(func, args, kwargs).arguments["pg_collection"].dp_cp.rank()


# -- save side --------------------------------------------------------------------------------------


@layer(ID, MODULE, "get_rng_state")
def get_rng_state(below_us, *args, **kwargs):
    """Bridge's ``get_rng_state``: ``fsdp_dtensor``, this rank's own entry beside the release's."""
    state = below_us(*args, **kwargs)
    if fsdp_dtensor_entry(state) is None:
        return state  # torch_dist: Bridge's own layout, per rank under EP already
    return with_per_rank_entry(state, _dp_cp_rank(below_us, args, kwargs))


# -- load side --------------------------------------------------------------------------------------


def _stored_keys(module, checkpoint_name):
    """The keys of the checkpoint's DCP metadata, read through Bridge's own reader (MSC URLs too)."""
    return module._get_filesystem_reader(checkpoint_name).read_metadata().state_dict_metadata


@layer(ID, MODULE, "load_fsdp_dtensor_checkpoint")
def load_fsdp_dtensor_checkpoint(below_us, *args, **kwargs):
    """See :func:`_load_fsdp_dtensor_checkpoint`; one ``.metadata`` read for its decision and the load together
    (:mod:`mcore_ckpt_fixes.dcp_metadata`)."""
    with shared_metadata():
        return _load_fsdp_dtensor_checkpoint(below_us, *args, **kwargs)


def _load_fsdp_dtensor_checkpoint(func, *args, **kwargs):
    """Bridge's ``load_fsdp_dtensor_checkpoint`` (``func``, what lies below the layer): ask for this
    rank's own RNG entry where the checkpoint has one, and hand ``load_checkpoint`` that entry under
    the key it reads."""
    try:
        bound = bind_arguments(func, args, kwargs)
    except TypeError:
        return func(*args, **kwargs)  # let the original raise its own error
    bound.apply_defaults()
    params = bound.arguments
    sharded = params.get("sharded_state_dict")
    request = sharded.get("rng_state") if isinstance(sharded, dict) else None
    if params.get("rank0") or fsdp_dtensor_entry(request) is None or own_entry_key(request) is None:
        return func(*args, **kwargs)
    module = sys.modules[MODULE]
    checkpoint_name = params.get("checkpoint_path_override")
    if checkpoint_name is None:
        checkpoint_name = module.get_checkpoint_name(params["load_dir"], params["iteration"], params["release"])
    request = dict(request)  # its keys as asked: this rank's own entry may be left out below
    sharded = dict(sharded)  # the caller's dict stays as it built it
    sharded["rng_state"] = dict(request)
    drop_absent_own_entry(sharded, _stored_keys(module, checkpoint_name))
    params["sharded_state_dict"] = sharded
    result = func(*bound.args, **bound.kwargs)
    warning = restore_own_entry(request, result[0]) if isinstance(result, tuple) else None
    if warning is not None:
        import warnings

        from ....engine.errors import MegatronPatchWarning

        warnings.warn(warning, MegatronPatchWarning, stacklevel=2)
    return result


# -- probe: run Bridge's real get_rng_state on stand-ins for what it reads ---------------------------


def _probe_once(module, dp_rank, ckpt_format):
    import torch

    fake_cuda = DelegatingNamespace(torch.cuda, get_rng_state=lambda device="cuda": torch.zeros(8, dtype=torch.uint8))
    fake_dist = DelegatingNamespace(torch.distributed, is_initialized=lambda: False)
    tracker = types.SimpleNamespace(get_states=lambda: {})
    stand_ins = {
        # No CUDA on the host, and get_cuda_rng_tracker() would create Megatron's global tracker.
        "torch": DelegatingNamespace(torch, cuda=fake_cuda, distributed=fake_dist),
        "tensor_parallel": DelegatingNamespace(module.tensor_parallel, get_cuda_rng_tracker=lambda *a, **k: tracker),
    }
    saved = {name: module.__dict__[name] for name in stand_ins if name in module.__dict__}
    missing = sorted(set(stand_ins) - set(saved))
    if missing:
        raise RuntimeError(f"{MODULE} no longer defines {', '.join(missing)}")
    # One rank of pp=1, tp=1, dp_cp=2 with EP=2 (the two EP ranks are the two data-parallel ranks).
    pgs = types.SimpleNamespace(
        pp=Group(),
        tp=Group(),
        dp=Group(dp_rank, 2),
        dp_cp=Group(dp_rank, 2),
        ep=Group(dp_rank, 2),
        expt_tp=Group(),
        expt_dp=Group(),
    )
    # In a copy of the module's globals with the stand-ins: the live module is left as it is.
    scope = module_scope(module, **stand_ins)
    return in_scope(original(module, "get_rng_state"), scope)(False, ckpt_format, pg_collection=pgs)


def probe(module: types.ModuleType):
    if not hasattr(module, "get_rng_state") or not hasattr(module, "load_fsdp_dtensor_checkpoint"):
        return None, f"{MODULE} has no get_rng_state / load_fsdp_dtensor_checkpoint"
    first, second = _probe_once(module, 0, "fsdp_dtensor"), _probe_once(module, 1, "fsdp_dtensor")
    if fsdp_dtensor_entry(first) is None or fsdp_dtensor_entry(second) is None:
        return None, "Bridge's get_rng_state(..., 'fsdp_dtensor') no longer returns a '(pp, tp)'-keyed entry"
    if set(first) != set(second):
        return False, "Bridge's get_rng_state gives every data-parallel rank its own fsdp_dtensor RNG entry"
    return True, (
        f"Bridge's get_rng_state keys the fsdp_dtensor RNG entry by (pp, tp) only: data-parallel (EP) "
        f"ranks 0 and 1 both write {sorted(first)}, so every EP rank resumes on a mix of the ranks' "
        f"RNG states"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    share_metadata_reads(patcher)  # the load side reads the metadata: shared with the load's own read
    # replace_function: `from megatron.bridge.training.checkpointing import get_rng_state` elsewhere
    # (Bridge's own modules, user training loops) is rebound as well.
    patcher.replace_function(module, "get_rng_state", get_rng_state)
    patcher.replace_function(module, "load_fsdp_dtensor_checkpoint", load_fsdp_dtensor_checkpoint)
