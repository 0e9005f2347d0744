"""expert-keys: every expert-parallel rank writes its experts under their global index (fsdp_dtensor).

Affected: Megatron-Core 0.16.0 - 0.19.2 (not fixed upstream at the time of writing). Upstream code:
``handle_experts_in_state_dict`` / ``expert_param_local_key`` / ``get_expert_index_from_key`` in
``megatron/core/transformer/fsdp_dtensor_checkpoint.py`` (NVIDIA/Megatron-LM, the Megatron-FSDP
``fsdp_dtensor`` checkpoint format); bound by name in ``megatron.training.checkpointing`` (0.17+, and
Megatron-LM checkouts) and ``megatron.core.optimizer.distrib_optimizer`` (optimizer state names).

Failures prevented, for ``fsdp_dtensor`` checkpoints under expert parallelism (EP > 1):

* TE grouped experts keep their biases as ``...mlp.experts.linear_fc1.bias{i}`` /
  ``linear_fc2.bias{i}`` with the *local* index ``i``. Upstream renames ``weight{i}`` to the global
  expert index but not ``bias{i}``, so every EP rank writes the same bias keys (model and optimizer
  state), DCP keeps one rank's copy, and on load the other EP ranks get that rank's expert biases:
  silently wrong, no error.
* ``num_experts=None`` with expert keys present: upstream "renames" each key to itself and then
  deletes it, so every expert tensor silently vanishes from the checkpoint. Now one clear
  ``ValueError`` naming the key and what is accepted.
* An un-indexed single grouped tensor (``moe_single_grouped_weight`` / ``_bias``, 0.18+:
  ``...linear_fc1.weight``, shape ``(num_local_experts, ...)``) trips ``AssertionError: Failed to
  parse expert index from key`` (weights), or is written by every EP rank under the same key and
  offsets (a grouped bias beside indexed weights: EP ranks silently load one rank's biases). It
  carries no index to rename: its expert index is its position on dim 0. With EP = 1 it is already
  global and kept as is. With EP > 1 the key is kept and the *tensor* is described as EP rank r's
  slice of the global ``(num_experts, ...)`` tensor, rows ``r * num_local ...``:
  ``handle_grouped_experts_in_state_dict`` runs after Megatron-FSDP's uneven-DTensor preprocessing
  (it reads the chunk that step computed over the expert-data-parallel mesh and shifts it by the EP
  block; no collective), for model and optimizer state alike. The value in the checkpointed dict is
  a new DTensor over the same storage (a load lands in the parameter), with the global shape; the
  nested dicts on its path are copies, so the dicts Megatron keeps (``raw_optimizer_state_dict``)
  still hold the parameter-shaped DTensors. Hook: ``megatron.training.checkpointing``'s binding of
  ``preprocess_state_dict_for_uneven_dtensor`` (its fsdp_dtensor save and load both call it);
  other callers (Megatron-Bridge, a script) call
  ``megatron.core.transformer.fsdp_dtensor_checkpoint.handle_grouped_experts_in_state_dict`` (with
  the source diff) or ``mcore_ckpt_fixes.fixes.expert_keys.handle_grouped_experts_in_state_dict``
  after their own preprocessing. SwiGLU halves of a grouped tensor (``weight_w``) under EP > 1 are
  refused with one ``ValueError``.

How: the three module-level functions are replaced (the engine rebinds them in every module that
imported them by name). Keys are parsed once by two patterns (TE grouped ``weight|bias`` with an
optional index and SwiGLU ``_w`` / ``_v`` suffix; SequentialMLP ``local_experts.{i}.``); an index is
made global (``i + ep_rank * num_local_experts``) or local again by rebuilding the key from its
parts, not by ``str.replace`` (which also hit ``weight1`` inside ``weight10``). Keys already carrying
this rank's global index are kept, as upstream does, so applying the renaming twice is harmless.

Loading a checkpoint an unfixed release wrote under EP > 1 (never silently): its expert biases are
stored under local indices (``...linear_fc1.bias0``, written by every EP rank, one copy kept), and
with the fix EP ranks > 0 ask for global keys (``bias2``, ``bias3``) that are not there; Megatron's
partial fsdp_dtensor load (the default; ``--strict-fsdp-dtensor-load`` fails on them instead) skips
missing keys with an info-level log. ``print_diff_in_state_dicts``, which
``megatron.training.checkpointing._load_base_checkpoint`` calls with the checkpoint's DCP metadata
and the state dict about to be loaded just before a partial load, is wrapped: after upstream's log it
looks at the metadata's keys (no tensor data) and, if expert biases carry fewer, lower indices than
the expert weights, emits a ``MegatronPatchWarning`` naming the old layout and the keys this rank
will not find (those tensors keep their current values). Ranks whose bias keys are present (EP rank
0) load the one saved copy, the best state there is, and are told it may be another EP rank's.
Single grouped tensors in the old layout (stored ``(n, ...)``, asked for as ``(ep * n, ...)``, which
DCP would refuse as a size mismatch) are handled the same way by pointing the request at what is
stored: EP rank 0 reads the one copy, the other EP ranks drop the tensor from the load and keep their
values, each with a warning (``align_old_grouped_expert_layout``). This load side is
monkeypatch-only: patches/expert-keys/ replaces the key functions and the preprocessing binding and
does not touch ``print_diff_in_state_dicts``, so a source-patched install loads such checkpoints
without it (bias keys: silently partial; grouped tensors: DCP's size-mismatch error).
"""

from __future__ import annotations

import re
import types

from ..engine.fix import Fix, Target
from ..engine.patching import Patcher, is_replacement, mark, original

ID = "expert-keys"
MODULE = "megatron.core.transformer.fsdp_dtensor_checkpoint"
NAMES = ("get_expert_index_from_key", "handle_experts_in_state_dict", "expert_param_local_key")
# Modules known to bind these names with ``from ... import`` (the engine rebinds every loaded module).
ALIAS_SITES = ("megatron.training.checkpointing", "megatron.core.optimizer.distrib_optimizer")
# Its fsdp_dtensor save and load call Megatron-FSDP's uneven-DTensor preprocessing through this name;
# only this binding is replaced (Megatron-FSDP's own fully_shard path has no expert parallelism).
TRAINING = "megatron.training.checkpointing"
UNEVEN = "megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor"


# -- replacement ---------------------------------------------------------------------------------
# (tools/patchgen/expert_keys.py copies the code from here to the end marker into the upstream file
# for patches/expert-keys/: keep it self-contained, ``re`` and ``sys`` only.)

# TE grouped experts: 'mlp.experts.linear_fc1.weight3', '...linear_fc2.bias3', SwiGLU halves
# '...linear_fc1.weight3_w' / '_v'; no index: one grouped tensor of all local experts (0.18+).
_GROUPED_EXPERT_KEY = re.compile(
    r"^(?P<head>(?:.*\.)?mlp\.experts\.linear_fc\d\.(?:weight|bias))(?P<index>\d*)(?P<tail>_[wv])?$"
)
# SequentialMLP: 'mlp.experts.local_experts.3.linear_fc1.weight' (weights and biases alike).
_SEQUENTIAL_EXPERT_KEY = re.compile(r"^(?P<head>(?:.*\.)?mlp\.experts\.local_experts\.)(?P<index>\d+)(?P<tail>\..+)$")


def _parse_expert_key(key):
    """(head, index or None, tail) for an expert key, None for any other key."""
    m = _GROUPED_EXPERT_KEY.match(key) or _SEQUENTIAL_EXPERT_KEY.match(key)
    if m is None:
        return None
    return m.group("head"), (int(m.group("index")) if m.group("index") else None), m.group("tail") or ""


def _ep_size_and_rank():
    """(EP size, EP rank) of this rank, from parallel_state."""
    import sys

    # Read through the module's namespace, not imported here: the probe swaps it for a stand-in.
    ps = sys.modules[MODULE].parallel_state
    # 0 (or None) when parallel_state is not initialised (a single-process conversion script): one
    # EP rank. (upstream's get_ep_layer_offset divides by it.)
    return max(ps.get_expert_model_parallel_world_size() or 1, 1), ps.get_expert_model_parallel_rank() or 0


def _ep_layout(num_experts):
    """(ep_size, ep_rank, num_local_experts, offset of this rank's first expert)."""
    ep_size, ep_rank = _ep_size_and_rank()
    num_local = num_experts // ep_size
    return ep_size, ep_rank, num_local, ep_rank * num_local


def get_expert_index_from_key(key):
    """The expert index in an expert key (weights and biases, TE grouped or SequentialMLP), else None.

    None also for a single grouped tensor (``...linear_fc1.weight``): it has no per-expert index.
    """
    parsed = _parse_expert_key(key)
    return None if parsed is None else parsed[1]


def handle_experts_in_state_dict(state_dict, num_experts=None):
    """Rename this EP rank's expert keys from local to global expert indices (weights and biases).

    Returns a copy; values are untouched (the optimizer maps parameters to names by identity).
    """
    parsed = {k: p for k, p in ((k, _parse_expert_key(k)) for k in state_dict) if p is not None}
    if not parsed:
        return state_dict.copy()
    if not num_experts:
        example = next(iter(parsed))
        raise ValueError(
            f"handle_experts_in_state_dict: num_experts={num_experts!r} but the state dict has expert "
            f"keys (e.g. {example!r}); pass the model's total number of experts "
            f"(config.num_moe_experts, an int > 0)"
        )
    ep_size, ep_rank, num_local, offset = _ep_layout(num_experts)
    renamed = {}
    for key, (head, index, tail) in parsed.items():
        if index is None:
            if ep_size > 1 and tail:
                raise ValueError(
                    f"handle_experts_in_state_dict: {key!r} is a SwiGLU half of one grouped tensor of "
                    f"this rank's {num_local} experts, which fsdp_dtensor checkpoints cannot place among "
                    f"the experts of other EP ranks (expert_model_parallel_size={ep_size}); accepted: "
                    f"per-expert tensors (moe_single_grouped_weight=False, moe_single_grouped_bias=False), "
                    f"swiglu=False, or expert_model_parallel_size=1"
                )
            # The key stays: EP = 1 holds every expert; under EP > 1 the tensor itself is described
            # as its EP block of the global tensor (handle_grouped_experts_in_state_dict).
            continue
        if offset <= index < offset + num_local:
            continue  # already this rank's global index (rank 0: local == global)
        if not 0 <= index < num_local:
            raise ValueError(
                f"handle_experts_in_state_dict: expert index {index} in {key!r} is neither a local "
                f"index (0..{num_local - 1}) nor one of EP rank {ep_rank}'s global indices "
                f"({offset}..{offset + num_local - 1}) for num_experts={num_experts}, "
                f"expert_model_parallel_size={ep_size}"
            )
        renamed[key] = f"{head}{index + offset}{tail}"
    out = state_dict.copy()
    out.clear()  # same mapping type as the input, keys in the input's order
    for key, value in state_dict.items():
        new_key = renamed.get(key, key)
        if new_key in out:
            raise ValueError(f"handle_experts_in_state_dict: {key!r} and another key both map to {new_key!r}")
        out[new_key] = value
    return out


def expert_param_local_key(key, num_experts=None):
    """The local parameter name of a key that carries a global expert index (weights and biases)."""
    parsed = _parse_expert_key(key)
    if parsed is None or parsed[1] is None or not num_experts:
        return key  # not an expert key, a grouped tensor without index, or nothing was renamed
    head, index, tail = parsed
    ep_size, ep_rank, num_local, offset = _ep_layout(num_experts)
    if not offset <= index < offset + num_local:
        raise ValueError(
            f"expert_param_local_key: expert index {index} in {key!r} is not one of EP rank {ep_rank}'s "
            f"global indices ({offset}..{offset + num_local - 1}) for num_experts={num_experts}, "
            f"expert_model_parallel_size={ep_size}"
        )
    return f"{head}{index - offset}{tail}"


def _is_single_grouped_expert_key(key):
    """A TE grouped-experts key without expert index (and without SwiGLU half): one tensor of all
    of this rank's experts, dim 0 the local expert (``moe_single_grouped_weight`` / ``_bias``)."""
    parsed = _parse_expert_key(key) if isinstance(key, str) else None
    return parsed is not None and parsed[1] is None and not parsed[2]


def _write_one_chunk(chunk, fqn, tensor):
    """DCP write items of a DTensor whose local data is exactly ``chunk`` of the global tensor."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = tensor.to_local()
    if local.numel() == 0:
        return []  # an empty FSDP shard: nothing of this tensor lives on this rank
    data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=tensor.size())
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]


def _ep_global_grouped_dtensor(key, dtensor, ep_size, ep_rank):
    """``dtensor`` (this EP rank's grouped experts, already given its chunk over the expert-data-
    parallel mesh) described as rows ``ep_rank * n ... (ep_rank + 1) * n`` of the global tensor of
    all ``ep_size * n`` experts. Same storage: a DCP load writes into the parameter."""
    import functools

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import DTensor

    if getattr(dtensor, "_ep_global_grouped_experts", False):
        return dtensor  # preprocessed twice: already global
    local = dtensor._local_tensor
    chunks = local.__create_chunk_list__() if hasattr(local, "__create_chunk_list__") else None
    if not chunks or len(chunks) != 1:
        raise ValueError(
            f"handle_grouped_experts_in_state_dict: {key!r} has no uneven-DTensor chunk metadata; "
            f"accepted: a state dict after preprocess_state_dict_for_uneven_dtensor (Megatron-FSDP)"
        )
    (chunk,) = chunks
    rows = dtensor.shape[0]
    shape = torch.Size((rows * ep_size, *dtensor.shape[1:]))
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    offsets = torch.Size((chunk.offsets[0] + ep_rank * rows, *chunk.offsets[1:]))
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=chunk.sizes)
    out = DTensor.from_local(
        local.detach(), dtensor.device_mesh, dtensor.placements, run_check=False, shape=shape, stride=tuple(stride)
    )
    out._local_tensor.__create_chunk_list__ = functools.partial(list, (chunk,))
    out._local_tensor.__create_write_items__ = functools.partial(_write_one_chunk, chunk)
    out._ep_global_grouped_experts = True
    out._ep_local_dtensor = dtensor  # what this rank asked for before: a load of an older layout reads it
    return out


def handle_grouped_experts_in_state_dict(state_dict):
    """Under EP > 1, describe every single grouped expert tensor (model and optimizer state) as
    this EP rank's block of the global tensor of all experts, so EP ranks write disjoint chunks
    of one key and each loads its own. Run after Megatron-FSDP's uneven-DTensor preprocessing.

    Updates ``state_dict`` in place at the top level; dicts below it on the path to a changed
    tensor are copied, never modified. Returns ``state_dict``.
    """
    from torch.distributed.tensor import DTensor

    ep_size, ep_rank = _ep_size_and_rank()
    if ep_size == 1:
        return state_dict

    def visit(mapping, grouped):
        changed = None
        for key, value in mapping.items():
            under = grouped or _is_single_grouped_expert_key(key)
            if isinstance(value, dict):
                new = visit(value, under)
            elif under and isinstance(value, DTensor):
                new = _ep_global_grouped_dtensor(key, value, ep_size, ep_rank)
            else:
                continue
            if new is not value:
                changed = mapping.copy() if changed is None else changed
                changed[key] = new
        return mapping if changed is None else changed

    state_dict.update(visit(state_dict, False))
    return state_dict


def preprocess_state_dict_for_uneven_dtensor(state_dict):
    """Megatron-FSDP's uneven-DTensor preprocessing, then single grouped expert tensors made
    EP-global (:func:`handle_grouped_experts_in_state_dict`)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor

    uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state_dict)
    return handle_grouped_experts_in_state_dict(state_dict)


# -- end of replacement ---------------------------------------------------------------------------

# The implementations above, as patches/expert-keys/ puts them into the upstream file.
_FIXED = {name: globals()[name] for name in (*NAMES, "preprocess_state_dict_for_uneven_dtensor")}


def _active(name, replacement, module_name=MODULE):
    """Is ``replacement`` still what the patched module binds? A module that imported the name
    after the fix was applied (``from ... import handle_experts_in_state_dict`` in
    ``distrib_optimizer`` or ``training.checkpointing``) holds our function and is not among the
    bindings ``revert()`` restores: once reverted, such a copy must behave as upstream's again."""
    import sys

    module = sys.modules.get(module_name)
    return module is not None and module.__dict__.get(name) is replacement


# The functions bound in Megatron's modules: plain module-level functions (picklable by name).


@mark(ID)
def get_expert_index_from_key(key):
    if not _active("get_expert_index_from_key", get_expert_index_from_key):
        return original(MODULE, "get_expert_index_from_key")(key)
    return _FIXED["get_expert_index_from_key"](key)


@mark(ID)
def handle_experts_in_state_dict(state_dict, num_experts=None):
    if not _active("handle_experts_in_state_dict", handle_experts_in_state_dict):
        return original(MODULE, "handle_experts_in_state_dict")(state_dict, num_experts)
    return _FIXED["handle_experts_in_state_dict"](state_dict, num_experts)


@mark(ID)
def expert_param_local_key(key, num_experts=None):
    if not _active("expert_param_local_key", expert_param_local_key):
        return original(MODULE, "expert_param_local_key")(key, num_experts)
    return _FIXED["expert_param_local_key"](key, num_experts)


@mark(ID)
def preprocess_state_dict_for_uneven_dtensor(state_dict):
    if not _active("preprocess_state_dict_for_uneven_dtensor", preprocess_state_dict_for_uneven_dtensor, TRAINING):
        return original(TRAINING, "preprocess_state_dict_for_uneven_dtensor")(state_dict)
    return _FIXED["preprocess_state_dict_for_uneven_dtensor"](state_dict)


for _name in _FIXED:  # the docstrings Megatron's readers see
    globals()[_name].__doc__ = _FIXED[_name].__doc__
del _name


# -- load: a checkpoint written by an unfixed release (monkeypatch only; not in the source diff) ----

# Any expert tensor key of a TE grouped MLP, model or optimizer state ('optimizer.state.<name>.exp_avg').
_INDEXED_EXPERT_KEY = re.compile(
    r"^(?P<head>(?:.*\.)?mlp\.experts\.linear_fc\d\.)(?P<kind>weight|bias)(?P<index>\d+)(?P<tail>(?:_[wv])?(?:\..*)?)$"
)
_NAMED_KEYS = 16  # keys spelled out in the warning; the rest are counted


def _old_bias_groups(meta_keys):
    """{(head, tail): (bias indices, weight indices)} where the checkpoint holds expert biases under
    fewer, lower indices than the weights: the unfixed layout (weights global, biases local)."""
    found = {}
    for key in meta_keys:
        m = _INDEXED_EXPERT_KEY.match(key)
        if m is not None:
            found.setdefault((m["head"], m["tail"]), ({}, {}))[m["kind"] == "weight"][int(m["index"])] = None
    old = {}
    for group, (biases, weights) in found.items():
        only_weights = set(weights) - set(biases)
        if biases and set(biases) < set(weights) and max(biases) < min(only_weights):
            old[group] = (sorted(biases), sorted(weights))
    return old


def old_expert_bias_layout_warning(state_dict_metadata, load_state_dict):
    """The warning text for loading ``load_state_dict`` from a checkpoint whose DCP metadata
    (``Metadata.state_dict_metadata``: keys only, no tensor data) has the unfixed bias layout, else None."""
    import sys

    old = _old_bias_groups(state_dict_metadata)
    if not old:
        return None
    module = sys.modules[MODULE]
    load_keys = module.flatten_state_dict(load_state_dict)
    missing = []
    for key in load_keys:
        m = _INDEXED_EXPERT_KEY.match(key)
        if m is not None and m["kind"] == "bias" and (m["head"], m["tail"]) in old and key not in state_dict_metadata:
            missing.append(key)
    missing.sort()
    (head, tail), (biases, weights) = sorted(old.items())[0]
    ep_size, ep_rank = _ep_size_and_rank()
    text = (
        f"expert-keys: this fsdp_dtensor checkpoint has the expert-bias layout of an unfixed Megatron-Core: "
        f"expert biases are stored under local indices (e.g. {head}bias{{{biases[0]}..{biases[-1]}}}{tail}) "
        f"while expert weights carry global indices ({head}weight{{{weights[0]}..{weights[-1]}}}{tail}); "
        f"every EP rank wrote the same bias keys, so only one EP rank's copy of the expert biases was saved. "
    )
    where = f"EP rank {ep_rank} of {ep_size}"
    if missing:
        named = ", ".join(repr(k) for k in missing[:_NAMED_KEYS])
        more = f" and {len(missing) - _NAMED_KEYS} more" if len(missing) > _NAMED_KEYS else ""
        text += (
            f"{where}: {len(missing)} expert bias keys are not in the checkpoint and keep their current "
            f"values (not loaded): {named}{more}. "
        )
    else:
        text += (
            f"{where}: its expert bias keys are in the checkpoint and load that one saved copy (the best "
            f"state there is; it may hold another EP rank's experts). "
        )
    return text + "Save again with the fix on to store every EP rank's expert biases."


def align_old_grouped_expert_layout(state_dict_metadata, load_state_dict):
    """Point the load of each single grouped expert tensor stored in the unfixed layout at what is
    stored, and return the warning text (None when nothing is in that layout).

    An unfixed release writes a grouped tensor under EP with its EP-local shape ``(n, ...)`` from
    every EP rank, and DCP keeps one copy. A fixed load asks for the global ``(ep * n, ...)`` tensor,
    which DCP would refuse (``Size mismatch``). As for indexed biases in the old layout: EP rank 0
    (whose global rows are the stored rows) loads that one copy, the best state there is; the other
    EP ranks do not load it and keep their current values. ``load_state_dict`` is the dict the
    partial load reads next; the dicts holding these tensors are the preprocessing's own copies.
    """
    ep_size, ep_rank = _ep_size_and_rank()
    old = []  # (flat key, stored shape, requested shape)

    def visit(mapping, prefix):
        for key in list(mapping):
            value, flat = mapping[key], f"{prefix}{key}"
            if isinstance(value, dict):
                visit(value, f"{flat}.")
                continue
            local = getattr(value, "_ep_local_dtensor", None)
            stored = getattr(state_dict_metadata.get(flat), "size", None)
            if local is None or stored is None or tuple(stored) != tuple(local.shape):
                continue
            old.append((flat, tuple(stored), tuple(value.shape)))
            if ep_rank == 0:
                mapping[key] = local
            else:
                del mapping[key]

    visit(load_state_dict, "")
    if not old:
        return None
    flat, stored, wanted = old[0]
    named = ", ".join(repr(k) for k, _, _ in old[:_NAMED_KEYS])
    more = f" and {len(old) - _NAMED_KEYS} more" if len(old) > _NAMED_KEYS else ""
    what = (
        "loads that one saved copy (the best state there is; it may hold another EP rank's experts)"
        if ep_rank == 0
        else "does not load them: they keep their current values (not loaded)"
    )
    return (
        f"expert-keys: this fsdp_dtensor checkpoint stores single grouped expert tensors in the layout of an "
        f"unfixed Megatron-Core: {flat!r} has shape {stored}, one EP rank's experts, where the model's "
        f"global tensor is {wanted}; every EP rank wrote the same key, so only one EP rank's copy was "
        f"saved. EP rank {ep_rank} of {ep_size} {what}: {len(old)} tensors: {named}{more}. "
        f"Save again with the fix on to store every EP rank's experts."
    )


@mark(ID)
def print_diff_in_state_dicts(state_dict_metadata, load_state_dict, *args, **kwargs):
    """Upstream's (logs, at info level, the keys a partial fsdp_dtensor load will skip), then a
    ``MegatronPatchWarning`` if the checkpoint holds expert biases or single grouped expert tensors
    in the unfixed layout (grouped ones: the load is pointed at what is stored, see
    :func:`align_old_grouped_expert_layout`)."""
    result = original(MODULE, "print_diff_in_state_dicts")(state_dict_metadata, load_state_dict, *args, **kwargs)
    if _active("print_diff_in_state_dicts", print_diff_in_state_dicts):
        texts = (
            old_expert_bias_layout_warning(state_dict_metadata, load_state_dict),
            align_old_grouped_expert_layout(state_dict_metadata, load_state_dict),
        )
        if any(texts):
            import warnings

            from ..engine.errors import MegatronPatchWarning

            for text in filter(None, texts):
                warnings.warn(text, MegatronPatchWarning, stacklevel=2)
    return result


# -- probe: the release's own functions on inert stand-ins -------------------------------------------

_PROBE_PREFIX = "decoder.layers.0.mlp.experts."


def _probe_parallel_state(real, ep_size, ep_rank):
    """Stands in for ``parallel_state`` in the module's namespace during the probe only."""
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.get_expert_model_parallel_world_size = lambda: ep_size
    ns.get_expert_model_parallel_rank = lambda: ep_rank
    return ns


def _call_with_ep(module, fns, name, ep_size, ep_rank, *args):
    """Call the release's ``name`` with the release's own helpers in place (after apply the module's
    globals are ours) and a fake EP layout, in the module's namespace for the duration only."""
    saved = {n: module.__dict__[n] for n in (*NAMES, "parallel_state") if n in module.__dict__}
    for n, fn in fns.items():
        if fn is not None:
            module.__dict__[n] = fn
    module.parallel_state = _probe_parallel_state(saved["parallel_state"], ep_size, ep_rank)
    try:
        return fns[name](*args)
    finally:
        module.__dict__.update(saved)


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
    """Does the uneven-DTensor preprocessing ``megatron.training.checkpointing`` calls give a single
    grouped expert tensor of EP rank 1 of 2 the global shape of all experts? Run with an EP stand-in
    in ``fsdp_dtensor_checkpoint``'s namespace and Megatron-FSDP's chunk computation (a collective)
    replaced by the local chunk, both for the duration of the call only."""
    import importlib

    name = "preprocess_state_dict_for_uneven_dtensor"
    fn = module.__dict__.get(name)
    if fn is None:
        return None, f"{TRAINING} does not bind {name} (Megatron-FSDP absent)"
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
    saved = (ckpt.__dict__["parallel_state"], uneven.__dict__["update_uneven_dtensor_chunk_metadata"])
    ckpt.parallel_state = _probe_parallel_state(saved[0], 2, 1)
    uneven.update_uneven_dtensor_chunk_metadata = local_chunk
    try:
        state = {"model": {key: grouped}}
        fn(state)
    finally:
        ckpt.parallel_state, uneven.update_uneven_dtensor_chunk_metadata = saved
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


FIX = Fix(
    id=ID,
    summary="fsdp_dtensor expert biases get global indices under EP; num_experts=None and grouped tensors handled",
    affected=">=0.16.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2: megatron/core/transformer/fsdp_dtensor_checkpoint.py "
        "handle_experts_in_state_dict renames expert weights only",
    ),
    targets=(Target(MODULE, probe, apply, alias_sites=ALIAS_SITES), Target(TRAINING, probe_training, apply_training)),
)
