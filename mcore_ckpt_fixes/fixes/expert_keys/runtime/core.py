"""expert-keys, the monkeypatch: marked wrappers around :mod:`.keys`' functions (bound in Megatron's
modules, with their own revert guard), the load-side wrapper of ``print_diff_in_state_dicts`` (warns
about checkpoints in an unfixed layout, see old_layouts.py), and the probes and apply functions of
the Megatron-Core targets (``megatron.core``'s fsdp_dtensor_checkpoint, ``megatron.training``'s
checkpointing); Bridge's and NeMo's are in :mod:`.bridge` and :mod:`.nemo`. Imported only when a
target module is.
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, below, is_replacement, mark, original
from ....engine.probing import in_scope, module_scope, module_scopes
from .. import ID, MODULE, NAMES, TRAINING, UNEVEN
from . import keys, old_layouts

# keys.py's implementations, as patches/expert-keys/ puts them into the upstream file.
_FIXED = {name: getattr(keys, name) for name in (*NAMES, "preprocess_state_dict_for_uneven_dtensor")}


def _active(name, replacement, module_name=MODULE):
    """Is ``replacement`` still what the patched module binds? A module that imported the name
    after the fix was applied (``from ... import handle_experts_in_state_dict`` in
    ``distrib_optimizer`` or ``training.checkpointing``) holds our function and is not among the
    bindings ``revert()`` restores: once reverted, such a copy must behave as upstream's again."""
    import sys

    module = sys.modules.get(module_name)
    return module is not None and module.__dict__.get(name) is replacement


# The functions bound in Megatron's modules: plain module-level functions (picklable by name).


@layer(ID, MODULE, "get_expert_index_from_key")
def get_expert_index_from_key(below_us, key):
    if not _active("get_expert_index_from_key", get_expert_index_from_key):
        return below_us(key)
    return _FIXED["get_expert_index_from_key"](key)


@layer(ID, MODULE, "handle_experts_in_state_dict")
def handle_experts_in_state_dict(below_us, state_dict, num_experts=None):
    if not _active("handle_experts_in_state_dict", handle_experts_in_state_dict):
        return below_us(state_dict, num_experts)
    return _FIXED["handle_experts_in_state_dict"](state_dict, num_experts)


@layer(ID, MODULE, "expert_param_local_key")
def expert_param_local_key(below_us, key, num_experts=None):
    if not _active("expert_param_local_key", expert_param_local_key):
        return below_us(key, num_experts)
    return _FIXED["expert_param_local_key"](key, num_experts)


def preprocess_through_binding(binding, replacement, state_dict):
    """The uneven-DTensor preprocessing as ``binding`` (a caller's module) binds it, with single
    grouped expert tensors made EP-global; the release's again once the fix is reverted."""
    name = "preprocess_state_dict_for_uneven_dtensor"
    if not _active(name, replacement, binding):
        return below(ID, binding, name)(state_dict)
    return _FIXED[name](state_dict)


@mark(ID)
def preprocess_state_dict_for_uneven_dtensor(state_dict):
    return preprocess_through_binding(TRAINING, preprocess_state_dict_for_uneven_dtensor, state_dict)


for _name in _FIXED:  # the docstrings Megatron's readers see
    globals()[_name].__doc__ = _FIXED[_name].__doc__
del _name


# -- load: a checkpoint written by an unfixed release (monkeypatch only; not in the source diff) ----


@layer(ID, MODULE, "print_diff_in_state_dicts")
def print_diff_in_state_dicts(below_us, state_dict_metadata, load_state_dict, *args, **kwargs):
    """Upstream's (logs, at info level, the keys a partial fsdp_dtensor load will skip), then a
    ``MegatronPatchWarning`` if the checkpoint holds expert biases or single grouped expert tensors
    in the unfixed layout (grouped ones: the load is pointed at what is stored, see
    :func:`.old_layouts.align_old_grouped_expert_layout`)."""
    result = below_us(state_dict_metadata, load_state_dict, *args, **kwargs)
    if _active("print_diff_in_state_dicts", print_diff_in_state_dicts):
        texts = (
            old_layouts.old_expert_bias_layout_warning(state_dict_metadata, load_state_dict),
            old_layouts.align_old_grouped_expert_layout(state_dict_metadata, load_state_dict),
        )
        if any(texts):
            import warnings

            from ....engine.errors import MegatronPatchWarning

            for text in filter(None, texts):
                warnings.warn(text, MegatronPatchWarning, stacklevel=3)  # the caller's line (past @layer's frame)
    return result


# -- probe: the release's own functions on inert stand-ins -------------------------------------------

_PROBE_PREFIX = "decoder.layers.0.mlp.experts."


def _probe_parallel_state(real, ep_size, ep_rank):
    """Stands in for ``parallel_state`` in a copy of the module's globals, for the probe only."""
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.get_expert_model_parallel_world_size = lambda: ep_size
    ns.get_expert_model_parallel_rank = lambda: ep_rank
    return ns


def _call_with_ep(module, fns, name, ep_size, ep_rank, *args):
    """Call the release's ``name`` with the release's own helpers (after apply the module's globals
    are ours) and a fake EP layout, all in a copy of the module's globals (the live module is left
    as it is)."""
    scope = module_scope(
        module, parallel_state=_probe_parallel_state(module.__dict__["parallel_state"], ep_size, ep_rank)
    )
    for n, fn in fns.items():
        if fn is not None:
            scope[n] = in_scope(fn, scope)
    return scope[name](*args)


def probe(module: types.ModuleType):
    fns = {}
    for name in NAMES:
        fn = module.__dict__.get(name)
        if fn is not None and is_replacement(fn):
            fn = original(module, name)  # re-probed after apply (reload): judge upstream's code
        fns[name] = fn
    if fns["handle_experts_in_state_dict"] is None or "parallel_state" not in module.__dict__:
        return None, f"{MODULE} has no handle_experts_in_state_dict (fsdp_dtensor expert handling absent)"
    problems = []

    def handle(ep_size, ep_rank, *args):
        return _call_with_ep(module, fns, "handle_experts_in_state_dict", ep_size, ep_rank, *args)

    # EP rank 1 of 2, 4 experts: local 0, 1 must become global 2, 3 for weights and biases alike.
    keys = [f"{_PROBE_PREFIX}linear_fc{f}.{p}{i}" for f in (1, 2) for p in ("weight", "bias") for i in (0, 1)]
    out = handle(2, 1, dict.fromkeys(keys), 4)
    if f"{_PROBE_PREFIX}linear_fc1.bias0" in out or f"{_PROBE_PREFIX}linear_fc1.bias2" not in out:
        problems.append("expert biases keep their local index under EP")

    # num_experts=None with expert keys: an error is fine, losing the keys is not.
    try:
        out = handle(1, 0, dict.fromkeys(keys), None)
        if len(out) != len(keys):
            problems.append("num_experts=None drops every expert key")
    except ValueError:
        pass

    # A single grouped tensor (no index) with EP = 1 must pass through.
    single = {f"{_PROBE_PREFIX}linear_fc1.weight": None, f"{_PROBE_PREFIX}linear_fc2.bias": None}
    try:
        out = handle(1, 0, single, 4)
        if set(out) != set(single):
            problems.append("a single grouped expert tensor is renamed")
    except AssertionError:
        problems.append("a single grouped expert tensor (no index) asserts")
    if not problems:
        # ... and under EP its key stays (the optimizer names its parameters through this function).
        try:
            if set(handle(2, 1, single, 4)) != set(single):
                problems.append("a single grouped expert tensor is renamed under EP")
        except (AssertionError, ValueError):
            problems.append("a single grouped expert tensor under EP is refused")

    if fns["expert_param_local_key"] is not None and not problems:
        key = f"module.{_PROBE_PREFIX}linear_fc1.bias3"
        got = _call_with_ep(module, fns, "expert_param_local_key", 2, 1, key, 4)
        if got != f"module.{_PROBE_PREFIX}linear_fc1.bias1":
            problems.append("expert_param_local_key does not map global bias indices back")
    if problems:
        return True, "; ".join(problems)
    return False, "expert weights and biases get global indices; num_experts=None and grouped tensors handled"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    replacements = {
        "get_expert_index_from_key": get_expert_index_from_key,
        "handle_experts_in_state_dict": handle_experts_in_state_dict,
        "expert_param_local_key": expert_param_local_key,
        # the fsdp_dtensor load's look at the checkpoint metadata (see "Loading a checkpoint ...")
        "print_diff_in_state_dicts": print_diff_in_state_dicts,
    }
    for name, new in replacements.items():
        if name in module.__dict__:
            # Also rebinds ``from ... import name`` in megatron.training.checkpointing,
            # megatron.core.optimizer.distrib_optimizer and any user module already loaded.
            patcher.replace_function(module, name, new)


# -- probe and apply for megatron.training.checkpointing: single grouped experts under EP -------------


def _probe_dtensor(rows):
    """A one-rank DTensor (rows, 2) needing no process group: the probe may run before
    ``init_process_group`` (at import) or on any rank after it."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", [0], _init_backend=False, _rank=0)
    return DTensor.from_local(torch.zeros(rows, 2), mesh, [Shard(0)], run_check=False)


def probe_training(module: types.ModuleType):
    """Does the uneven-DTensor preprocessing ``megatron.training.checkpointing`` (or Megatron-Bridge's
    ``megatron.bridge.training.checkpointing``) calls give a single grouped expert tensor of EP rank
    1 of 2 the global shape of all experts? Run with an EP stand-in in ``fsdp_dtensor_checkpoint``'s
    namespace and Megatron-FSDP's chunk computation (a collective) replaced by the local chunk, both
    in copies of the modules' globals only."""
    import importlib

    name = "preprocess_state_dict_for_uneven_dtensor"
    fn = module.__dict__.get(name)
    if fn is None:
        return None, f"{module.__name__} does not bind {name} (Megatron-FSDP absent)"
    if is_replacement(fn):
        fn = original(module, name)  # re-probed after apply (reload): judge the release's binding
    ckpt = importlib.import_module(MODULE)
    uneven = importlib.import_module(UNEVEN)
    try:
        grouped = _probe_dtensor(2)
    except TypeError:  # a torch whose DeviceMesh cannot be built without a process group
        buggy = fn is uneven.__dict__.get(name)
        return buggy, f"{name} is Megatron-FSDP's own (not probed: DeviceMesh needs a process group here)"

    def local_chunk(dtensor):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        chunk = ChunkStorageMetadata(offsets=(0,) * dtensor.dim(), sizes=dtensor.to_local().shape)
        dtensor._local_tensor.__create_chunk_list__ = lambda: [chunk]

    key = f"{_PROBE_PREFIX}linear_fc1.weight"
    # The preprocessing and what it calls, in linked copies of the modules' globals: the live
    # modules are left as they are.
    overrides = {
        ckpt: {"parallel_state": _probe_parallel_state(ckpt.__dict__["parallel_state"], 2, 1)},
        uneven: {"update_uneven_dtensor_chunk_metadata": local_chunk},
    }
    home = sys.modules.get(fn.__module__)
    if home is not None:
        overrides.setdefault(home, {})
    scopes = module_scopes(overrides)
    if home is not None and "_megatron_fsdp_uneven_dtensor_preprocessing" in scopes[home]:
        # A source carrying this fix's diff: its preprocessing calls Megatron-FSDP's through that
        # name; here, the copy with the local chunk.
        scopes[home]["_megatron_fsdp_uneven_dtensor_preprocessing"] = scopes[uneven][
            "preprocess_state_dict_for_uneven_dtensor"
        ]
    state = {"model": {key: grouped}}
    in_scope(fn, scopes[home] if home is not None else dict(fn.__globals__))(state)
    got = tuple(state["model"][key].shape)
    if got == (4, 2):
        return False, "a single grouped expert tensor is saved as its EP block of the global tensor"
    return True, (
        f"a single grouped expert tensor keeps its EP-local shape {got} under EP (every EP rank writes "
        f"the same key and offsets)"
    )


def apply_training(module: types.ModuleType, patcher: Patcher) -> None:
    # This module's binding only (not rebound elsewhere): see TRAINING.
    patcher.replace(module, "preprocess_state_dict_for_uneven_dtensor", preprocess_state_dict_for_uneven_dtensor)
