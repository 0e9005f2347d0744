"""rng-under-ep, the monkeypatch: the wrapped ``get_rng_state`` (save side), the wrapped
``_load_global_dist_base_checkpoint`` (load side, which asks :mod:`.old_layouts` what to request),
the probe and apply. What the fix prevents: the package docstring; how, in full: its doc.md. Imported only when
``megatron.training.checkpointing`` is.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

from ....dcp_metadata import install as share_metadata_reads, shared_metadata
from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import Group, in_scope, module_scope
from .. import ID, MODULE
from . import fsdp_dtensor
from .fsdp_dtensor import fsdp_dtensor_entry, restore_own_entry, with_per_rank_entry
from .old_layouts import align_rng_request, restores_own_copy

_SIGNATURES: dict = {}


def bind_arguments(func, args, kwargs):
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = _SIGNATURES[func] = inspect.signature(func)
    return sig.bind(*args, **kwargs)


def is_rng_object(obj) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return isinstance(obj, ShardedObject) and obj.key.endswith("rng_state")


def _dp_cp_group_arg(func, args, kwargs):
    """The ``dp_cp_group`` a caller passed (0.19 takes one), or None."""
    try:
        return bind_arguments(func, args, kwargs).arguments.get("dp_cp_group")
    except TypeError:
        return None


def _dp_cp_rank_and_size(dp_cp_group):
    """This rank's index in, and the size of, the data-parallel x context-parallel group: the one
    Megatron uses as the RNG replica id (0.19 lets callers pass the group)."""
    if dp_cp_group is not None:
        from megatron.core.utils import get_pg_rank, get_pg_size

        return get_pg_rank(dp_cp_group), get_pg_size(dp_cp_group)
    from megatron.core import parallel_state as mpu

    return (
        mpu.get_data_parallel_rank(with_context_parallel=True),
        mpu.get_data_parallel_world_size(with_context_parallel=True),
    )


# -- save side -------------------------------------------------------------------------------------


@layer(ID, MODULE, "get_rng_state")
def get_rng_state(below_us, *args, **kwargs):
    """``megatron.training.checkpointing.get_rng_state``, with the RNG state of every rank its own:
    ``torch_dist``, a per-rank ShardedObject; ``fsdp_dtensor``, a per-rank entry beside the release's."""
    state = below_us(*args, **kwargs)
    if fsdp_dtensor_entry(state) is not None:
        dp_cp_rank, _ = _dp_cp_rank_and_size(_dp_cp_group_arg(below_us, args, kwargs))
        return with_per_rank_entry(state, dp_cp_rank)
    if not is_rng_object(state) or len(state.global_shape) != 2:
        return state  # torch / torch_dcp: a plain list, left as the release writes it
    dp_cp_rank, dp_cp_size = _dp_cp_rank_and_size(_dp_cp_group_arg(below_us, args, kwargs))
    return dataclasses.replace(
        state,
        global_shape=(*state.global_shape, dp_cp_size),
        global_offset=(*state.global_offset, dp_cp_rank),
        replica_id=0,  # no other rank holds this state: it must be written by this rank
    )


# -- load side (what to request for which stored layout: old_layouts.py) ---------------------------


@layer(ID, MODULE, "_load_global_dist_base_checkpoint")
def load_global_dist_base_checkpoint(below_us, *args, **kwargs):
    """``megatron.training.checkpointing._load_global_dist_base_checkpoint``: request the RNG shard
    in the layout the checkpoint has."""
    try:
        bound = bind_arguments(below_us, args, kwargs)
    except TypeError:
        return below_us(*args, **kwargs)  # let the original raise its own error
    params = bound.arguments
    sharded = params.get("sharded_state_dict")
    template = sharded.get("rng_state") if isinstance(sharded, dict) else None
    if params.get("rank0") or template is None or not is_rng_object(template) or len(template.global_shape) != 3:
        return below_us(*args, **kwargs)
    # One .metadata read per rank for the decision and the load together (dcp_metadata).
    with shared_metadata():
        return _load_aligned(below_us, bound, template)


def _load_aligned(func, bound, template):
    params = bound.arguments
    sharded = params["sharded_state_dict"]
    module = sys.modules[MODULE]
    checkpoint_dir = module.get_checkpoint_name(
        params["load_dir"], params["iteration"], params["release"], return_base_dir=True
    )
    request, warning = align_rng_request(template, checkpoint_dir)
    old_layout = request is not None and len(request.global_shape) == 2
    if warning is not None and not old_layout:
        _warn(warning, stacklevel=5)  # the caller's line, past @layer's frame
    if request is template:
        return func(*bound.args, **bound.kwargs)
    sharded = dict(sharded)  # the caller's dict stays as it built it
    if request is None:
        del sharded["rng_state"]
    else:
        sharded["rng_state"] = request
    params["sharded_state_dict"] = sharded
    result = func(*bound.args, **bound.kwargs)
    if request is None:
        # load_checkpoint restores whatever it finds under "rng_state": hand it this rank's current
        # states (what get_rng_state collected for the request), so restoring changes nothing.
        result[0]["rng_state"] = template.data
    if warning is not None and old_layout:
        _tell_old_layout(warning, template, params.get("args"), result)
    return result


def _warn(text, stacklevel):
    import warnings

    from ....engine.errors import MegatronPatchWarning

    warnings.warn(text, MegatronPatchWarning, stacklevel=stacklevel)


def _tell_old_layout(text, template, args, result):
    """The old layout's one copy was restored: a warning on a rank whose restored state is not its
    own; where it is, the same text is logged (INFO on global rank 0, DEBUG elsewhere), so that a job
    hears of the old layout once, not once per rank."""
    from ....engine import logs

    try:
        from megatron.core import parallel_state as mpu

        copy = result[0].get("rng_state") if isinstance(result, tuple) and isinstance(result[0], dict) else None
        own = restores_own_copy(
            template.global_offset[2],
            copy,
            bool(getattr(args, "data_parallel_random_init", False)),
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
        )
    except Exception:  # groups not from parallel_state (or not initialised): cannot tell, so warn
        own = False
    if own:
        logs.once_per_job("%s (here: this rank's own state, restored as saved)", text)
    else:
        _warn(text, stacklevel=6)  # the caller's line, past @layer's frame


@layer(ID, MODULE, "_load_base_checkpoint")
def load_base_checkpoint(below_us, *args, **kwargs):
    """``megatron.training.checkpointing._load_base_checkpoint``: after an ``fsdp_dtensor`` load,
    hand load_checkpoint this rank's own RNG entry under the key it looks up (:mod:`.fsdp_dtensor`)."""
    try:
        sharded = bind_arguments(below_us, args, kwargs).arguments.get("sharded_state_dict")
    except TypeError:
        sharded = None
    request = sharded.get("rng_state") if isinstance(sharded, dict) else None
    if request is None or fsdp_dtensor_entry(request) is None:
        return below_us(*args, **kwargs)
    request = dict(request)  # its keys as asked: the planner may leave this rank's own entry out
    result = below_us(*args, **kwargs)
    if not isinstance(result, tuple):
        return result
    warning = restore_own_entry(request, result[0])
    if warning is not None:
        import warnings

        from ....engine.errors import MegatronPatchWarning

        warnings.warn(warning, MegatronPatchWarning, stacklevel=3)  # the caller's line, past @layer's frame
    return result


# -- probe: run the real get_rng_state on stand-ins for what it reads ---------------------------------


class ProbeParallelState:
    """``parallel_state`` as one rank of pp=1, tp=1, dp_cp=2 sees it (nothing initialised)."""

    def __init__(self, dp_rank):
        self.dp_rank = dp_rank

    def get_data_parallel_rank(self, with_context_parallel=False, partial_data_parallel=False):
        return self.dp_rank

    def get_data_parallel_world_size(self, with_context_parallel=False, partial_data_parallel=False):
        return 2

    def get_data_parallel_group(self, with_context_parallel=False, partial_data_parallel=False):
        return Group(rank=self.dp_rank, size=2)

    def get_pipeline_model_parallel_rank(self):
        return 0

    def get_tensor_model_parallel_rank(self):
        return 0

    def __getattr__(self, name):
        raise AttributeError(f"probe stand-in for parallel_state has no {name}")


class DelegatingNamespace:
    """A namespace that answers from ``overrides`` first, then from ``real``."""

    def __init__(self, real, **overrides):
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _probe_once(module, dp_rank):
    import torch

    fake_cuda = DelegatingNamespace(torch.cuda, get_rng_state=lambda device="cuda": torch.zeros(8, dtype=torch.uint8))
    fake_dist = DelegatingNamespace(torch.distributed, is_initialized=lambda: False)
    tracker = types.SimpleNamespace(get_states=lambda: {})
    stand_ins = {
        "get_args": lambda: types.SimpleNamespace(data_parallel_random_init=False),
        "mpu": ProbeParallelState(dp_rank),
        # The real CUDA generator and RNG tracker are not touched: no CUDA on the host, and
        # get_cuda_rng_tracker() would create Megatron's global tracker with default settings.
        "torch": DelegatingNamespace(torch, cuda=fake_cuda, distributed=fake_dist),
        "tensor_parallel": DelegatingNamespace(module.tensor_parallel, get_cuda_rng_tracker=lambda *a, **k: tracker),
    }
    saved = {name: module.__dict__[name] for name in stand_ins if name in module.__dict__}
    missing = sorted(set(stand_ins) - set(saved))
    if missing:
        raise RuntimeError(f"{MODULE} no longer defines {', '.join(missing)}")
    # In a copy of the module's globals with the stand-ins: the live module is left as it is.
    scope = module_scope(module, **stand_ins)
    return in_scope(original(module, "get_rng_state"), scope)("torch_dist", Group(), Group())


def probe(module: types.ModuleType):
    if not hasattr(module, "get_rng_state") or not hasattr(module, "_load_global_dist_base_checkpoint"):
        return None, f"{MODULE} has no get_rng_state / _load_global_dist_base_checkpoint"
    return torch_dist_verdict(
        _probe_once(module, 0), _probe_once(module, 1), "get_rng_state", "get_rng_state('torch_dist', ...)"
    )


def torch_dist_verdict(first, second, who, call):
    """The probe's verdict from what ``who`` (Megatron's get_rng_state or a framework's copy, called as
    ``call``) returned for data-parallel ranks 0 and 1 of one (pp, tp): the same shard with rank 1 a
    replica is the bug."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    if not (isinstance(first, ShardedObject) and isinstance(second, ShardedObject)):
        return None, f"{call} no longer returns a ShardedObject"
    if first.unique_key != second.unique_key and is_main_replica(second.replica_id):
        return False, f"{who} gives every data-parallel rank its own torch_dist RNG shard"
    return True, (
        f"{who} keys the torch_dist RNG state by (pp, tp) only: data-parallel ranks 0 and 1 "
        f"both address {first.unique_key} and rank 1 is a replica (replica_id={second.replica_id}), "
        f"so EP ranks > 0 resume on another rank's RNG streams"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    # replace_function: `from megatron.training.checkpointing import get_rng_state` elsewhere
    # (user code, forks of the training loop) is rebound as well.
    patcher.replace_function(module, "get_rng_state", get_rng_state)
    patcher.replace_function(module, "_load_global_dist_base_checkpoint", load_global_dist_base_checkpoint)
    if hasattr(module, "_load_base_checkpoint"):
        patcher.replace_function(module, "_load_base_checkpoint", load_base_checkpoint)
    # The load side reads the checkpoint's metadata: shared with the load's own read.
    share_metadata_reads(patcher)
    if hasattr(module, "default_planner"):
        # Namespace-local: only load_checkpoint's fsdp_dtensor branch plans through it.
        # Read through the module: revert points globals that hold a replacement back at the
        # original everywhere except in the module that defines it.
        patcher.replace(module, "default_planner", fsdp_dtensor.DEFAULT_PLANNER)
