"""gdn-fsdp-split's replacement: ``handle_gdn_in_state_dict`` with a split that issues no collective.

:mod:`.core` binds these very functions (marked as this fix's) in a user's job. The source diff
(``diff/core.py``) replaces upstream's ``handle_gdn_in_state_dict`` (with its nested
``split_gdn_fused``) by the code between the "replacement" markers below, taken verbatim except for
one mechanical edit: ``MODULE`` (the upstream module's name) is read as ``__name__``. The runtime
and the diff are the same code by construction; tests/patches/test_source_patches.py checks that the
patched source satisfies the fix's probe and round-trips with the monkeypatch off.

Its layout is the diff's layout: ruff does not reformat this file.
"""

from __future__ import annotations

from .. import MODULE

# -- replacement ---------------------------------------------------------------------------------
# Everything from here to "end of replacement" is also what ``diff/core.py`` writes into
# fsdp_dtensor_checkpoint.py for the source diffs (with ``sys.modules[MODULE]`` read as the module
# itself), so the monkeypatch and the diffs cannot drift apart. Names the upstream module uses
# (``DTensor``, ``HAVE_MEGATRON_FSDP``) are looked up in that module. core.py marks the function as
# this fix's replacement; nothing here imports torch or megatron at import.

_GDN_IN_PROJ_NAMES = ("query", "key", "value", "z", "beta", "alpha")
_GDN_CONV1D_NAMES = ("query", "key", "value")


def _gdn_strip_wrappers(path):
    parts = path.split(".")
    while parts and parts[0] in ("module", "model"):
        parts = parts[1:]
    return ".".join(parts)


def handle_gdn_in_state_dict(model, model_state_dict, optimizer_state_dict):
    """Split GDN fused projections (in_proj 6-way, conv1d 3-way) into per-component DTensors.

    Same keys, and the checkpoint upstream writes for TP-global tensors; issues no collective, so
    every rank takes the same steps whatever tensor type or layout it holds (TP-global or TP-local
    DTensor, plain local Tensor).
    """
    import sys

    upstream = sys.modules[MODULE]
    assert upstream.HAVE_MEGATRON_FSDP, "This function requires Megatron-FSDP to be installed."

    gdn = {}  # normalized module path -> (in_proj sizes, conv1d sizes, tp_size of the module)
    for name, mod in model.named_modules():
        if not (hasattr(mod, "qk_dim") and hasattr(mod, "v_dim") and hasattr(mod, "in_proj_dim")):
            continue
        tp = getattr(mod, "tp_size", 1)
        qk, v, nvh = mod.qk_dim // tp, mod.v_dim // tp, mod.num_value_heads // tp
        gdn[_gdn_strip_wrappers(name)] = ([qk, qk, v, v, nvh, nvh], [qk, qk, v], tp)
    if not gdn:
        return model_state_dict, optimizer_state_dict

    params = None  # normalized name -> parameter, built only if upstream's lookup misses

    def match(key):
        norm = _gdn_strip_wrappers(key)
        for path, (in_proj, conv1d, tp) in gdn.items():
            if not norm.startswith(path + "."):
                continue
            rel = norm[len(path) + 1 :]
            if rel == "in_proj.weight":
                return in_proj, _GDN_IN_PROJ_NAMES, tp
            if rel in ("conv1d.weight", "conv1d.bias"):
                return conv1d, _GDN_CONV1D_NAMES, tp
        return None

    def parameter(name):
        nonlocal params
        try:
            return model.get_parameter(name)
        except AttributeError:
            if params is None:
                params = {_gdn_strip_wrappers(n): p for n, p in model.named_parameters()}
            try:
                return params[_gdn_strip_wrappers(name)]
            except KeyError:
                raise AttributeError(f"[GDN] no parameter {name!r} in the model") from None

    model_state_dict = model_state_dict.copy()
    count = 0
    for key in list(model_state_dict.keys()):
        found = match(key)
        if found is None:
            continue
        sizes, names, tp = found
        dist_param = parameter(f"module.{key}")
        pieces = split_gdn_fused(model_state_dict[key], dist_param, sizes, tp, key, upstream.DTensor)
        for sub, tensor in zip(names, pieces):
            model_state_dict[f"{key}.{sub}"] = tensor
        del model_state_dict[key]
        count += 1
    if count:
        import logging  # lazily: import mcore_ckpt_fixes stays light

        logging.getLogger(MODULE).info(f"[GDN] Split {count} fused keys into sub-tensors (in_proj/conv1d → query/key/value/...).")

    if optimizer_state_dict is not None:
        optimizer_state_dict = optimizer_state_dict.copy()
        if len(optimizer_state_dict["state"]) != 0:
            state = optimizer_state_dict["state"]
            new_state = {}
            for key in list(state.keys()):
                found = match(key)
                if found is None:
                    new_state[key] = state[key]
                    continue
                sizes, names, tp = found
                for sub in names:
                    new_state[f"{key}.{sub}"] = state[key].copy()
                dist_param = parameter(key[len("module.") :] if key.startswith("module.") else key)
                for subkey in ("exp_avg", "exp_avg_sq"):
                    if subkey not in state[key]:
                        continue
                    pieces = split_gdn_fused(state[key][subkey], dist_param, sizes, tp, f"{key}/{subkey}", upstream.DTensor)
                    for sub, tensor in zip(names, pieces):
                        new_state[f"{key}.{sub}"][subkey] = tensor
            optimizer_state_dict["state"] = new_state

    return model_state_dict, optimizer_state_dict


def _gdn_tp_coordinates(dist_param):
    """(tp_size, tp_rank) of this rank, read from the parameter's mesh (local: no collective)."""
    index = getattr(dist_param, "megatron_fsdp_dist_index", None)
    tp_dim = getattr(index, "tp_dim", None)
    mesh = getattr(index, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if tp_dim is None or tp_dim not in names:
        return 1, 0
    dim = names.index(tp_dim)
    return mesh.size(dim), mesh.get_local_rank(dim)


def split_gdn_fused(data, dist_param, split_sizes, module_tp, key, DTensor):
    """This rank's pieces of a fused GDN tensor, as TP-global DTensors with their chunk metadata.

    Everything it decides on comes from metadata identical on every rank (the parameter's global
    shape, the module's sizes, the mesh) plus this rank's own coordinates: no collective.
    ``DTensor``: the class as the Megatron module names it (the probe swaps in an inert stand-in).

    Two ways to know where this rank's local part lies in the fused tensor: a Megatron-FSDP
    parameter says it in ``megatron_fsdp_slice`` (a flat slice of the TP-local tensor); any other
    DTensor says it in its own mesh and placements (torch's ``distribute_tensor``, a conversion
    script's ``DTensor.from_local``). The choice depends on attributes of the parameter and the
    sizes of the data, never on another rank.
    """
    local = data.to_local() if isinstance(data, DTensor) else data
    start = _gdn_fsdp_start(dist_param, local.numel(), split_sizes)
    if start is not None:
        return _gdn_split_fsdp_slice(local, start, data, dist_param, split_sizes, module_tp, key, DTensor)
    if isinstance(data, DTensor) or isinstance(dist_param, DTensor):
        return _gdn_split_by_placements(data, dist_param, split_sizes, module_tp, key, DTensor)
    raise TypeError(f"[GDN] {key}: neither the data nor the parameter is a DTensor")


def _gdn_fsdp_start(dist_param, n, split_sizes):
    """Where this rank's ``n`` local elements start in the flat TP-local fused tensor, for a
    Megatron-FSDP parameter: its slice's start, or 0 for a whole TP-local copy; None for anything
    else (a DTensor whose own placements say where it lies)."""
    import math

    if getattr(dist_param, "megatron_fsdp_dist_index", None) is None:
        return None
    fsdp_slice = getattr(dist_param, "megatron_fsdp_slice", None)
    if fsdp_slice is not None and fsdp_slice.stop - fsdp_slice.start == n:
        return fsdp_slice.start
    if n == sum(split_sizes) * math.prod(dist_param.shape[1:]):
        return 0
    return None


def _gdn_split_fsdp_slice(local, start, data, dist_param, split_sizes, module_tp, key, DTensor):
    """Pieces of this rank's Megatron-FSDP slice (or of a whole TP-local copy), ``local`` from flat
    element ``start`` of the TP-local fused tensor."""
    import math

    tp_size, tp_rank = _gdn_tp_coordinates(dist_param)
    local_rows = sum(split_sizes)
    row_shape = list(dist_param.shape[1:])
    row_numel = math.prod(row_shape)
    if module_tp != tp_size or dist_param.shape[0] != local_rows * tp_size:
        raise ValueError(
            f"[GDN] {key}: parameter shape {tuple(dist_param.shape)} does not hold {tp_size} TP "
            f"shards of {local_rows} rows (module tp_size={module_tp}, mesh TP size={tp_size})"
        )
    stop = start + local.numel()
    if start % row_numel or stop % row_numel:
        raise ValueError(f"[GDN] {key}: Megatron-FSDP slice {start}:{stop} is not row-aligned ({row_numel})")

    if isinstance(dist_param, DTensor):
        mesh, placements = dist_param.device_mesh, dist_param.placements
    elif isinstance(data, DTensor):
        mesh, placements = data.device_mesh, data.placements
    else:
        raise TypeError(f"[GDN] {key}: neither the data nor the parameter is a DTensor")

    rows = local.reshape(-1, *row_shape)  # a view for the contiguous local shards Megatron-FSDP hands out
    return _gdn_pieces(rows, start // row_numel, [0] * len(row_shape), row_shape, split_sizes, tp_size, tp_rank,
                       mesh, placements, DTensor)


def _gdn_split_by_placements(data, dist_param, split_sizes, module_tp, key, DTensor):
    """Pieces of a DTensor that carries no Megatron-FSDP slice: its mesh and placements place it."""
    src = data if isinstance(data, DTensor) else dist_param
    local = data.to_local() if isinstance(data, DTensor) else data
    offsets, sizes = _gdn_local_chunk(src, key)
    if tuple(local.shape) != tuple(sizes):
        raise ValueError(
            f"[GDN] {key}: local part has shape {tuple(local.shape)}, but placements {tuple(src.placements)} "
            f"give this rank {tuple(sizes)} of {tuple(src.shape)}; accepted: torch's Shard chunking "
            "(ceil(n / mesh size) rows per rank) or chunk metadata attached by Megatron-FSDP"
        )
    local_rows, global_rows = sum(split_sizes), src.shape[0]
    if global_rows == local_rows:  # TP-local: the TP rank comes from outside the DTensor
        tp_size, tp_rank = _gdn_tp_of_tp_local(src, dist_param, module_tp, key)
        first = offsets[0]
    elif global_rows == local_rows * module_tp:  # TP-global: the rows say which TP rank's block
        tp_size, tp_rank = module_tp, offsets[0] // local_rows
        first = offsets[0] - tp_rank * local_rows
        if sizes[0] and first + sizes[0] > local_rows:
            raise ValueError(
                f"[GDN] {key}: this rank holds rows {offsets[0]}:{offsets[0] + sizes[0]} of a TP-global "
                f"tensor of {module_tp} blocks of {local_rows} rows; accepted: a local part within one TP block"
            )
    else:
        raise ValueError(
            f"[GDN] {key}: DTensor of shape {tuple(src.shape)} is neither TP-local ({local_rows} rows) nor "
            f"TP-global ({local_rows * module_tp} rows) for module tp_size={module_tp}"
        )
    return _gdn_pieces(local, first, list(offsets[1:]), list(src.shape[1:]), split_sizes, tp_size, tp_rank,
                       src.device_mesh, src.placements, DTensor)


def _gdn_local_chunk(dtensor, key):
    """(offsets, sizes) of this rank's local part in the DTensor's global shape, without a collective:
    the chunk metadata Megatron-FSDP attached, else torch's chunking from the mesh coordinate."""
    import sys

    attached = getattr(dtensor._local_tensor, "__create_chunk_list__", None)
    if attached is not None:
        chunks = attached()
        if len(chunks) == 1:
            return list(chunks[0].offsets), list(chunks[0].sizes)
    upstream = sys.modules[MODULE]
    coord = dtensor.device_mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"[GDN] {key}: this rank is not in the DTensor's device mesh")
    offsets, extent = [0] * dtensor.dim(), list(dtensor.shape)
    for i, p in enumerate(dtensor.placements):
        if type(p) is upstream.Replicate:
            continue
        if type(p) is not upstream.Shard:  # Partial, _StridedShard: no contiguous local chunk
            raise ValueError(f"[GDN] {key}: cannot split a DTensor placed {p!r}; accepted: Shard(dim), Replicate()")
        d, n = p.dim % dtensor.dim(), dtensor.device_mesh.size(i)
        chunk = -(-extent[d] // n)
        start = min(coord[i] * chunk, extent[d])
        offsets[d] += start
        extent[d] = max(0, min(chunk, extent[d] - start))
    return offsets, extent


def _gdn_tp_of_tp_local(dtensor, dist_param, module_tp, key):
    """(tp_size, tp_rank) for a TP-local DTensor: 1 for a TP=1 module, else the parameter's
    Megatron-FSDP mesh, a 'tp' dimension of the DTensor's mesh, or parallel_state's TP group."""
    import sys

    if module_tp == 1:
        return 1, 0
    found = _gdn_tp_coordinates(dist_param)
    names = getattr(dtensor.device_mesh, "mesh_dim_names", None) or ()
    if found[0] == 1 and "tp" in names:
        dim = names.index("tp")
        found = dtensor.device_mesh.size(dim), dtensor.device_mesh.get_local_rank(dim)
    if found[0] == 1:
        import torch.distributed as dist

        group = sys.modules[MODULE].parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        if group is not None:
            found = dist.get_world_size(group), dist.get_rank(group)
    if found[0] != module_tp:
        raise ValueError(
            f"[GDN] {key}: TP-local DTensor of a module with tp_size={module_tp}, but this rank's TP size "
            f"is {found[0]} (read from the parameter's Megatron-FSDP mesh, a 'tp' mesh dimension, or "
            "parallel_state); accepted: one of those naming the module's TP size, or TP-global tensors"
        )
    return found


def _gdn_pieces(rows, first, tail_offsets, row_shape, split_sizes, tp_size, tp_rank, mesh, placements, DTensor):
    """Cut ``rows`` (this rank's rows ``first...`` of the TP-local fused tensor, a view) into one
    TP-global DTensor per component, each with the chunk it holds."""
    import torch

    last = first + rows.shape[0]
    pieces, row = [], 0
    for size in split_sizes:
        lo, hi = max(first, row), min(last, row + size)
        if lo >= hi:
            lo, part = min(max(first, row), row + size), rows[0:0]
        else:
            part = rows[lo - first : hi - first]
        global_shape = [size * tp_size] + list(row_shape)
        piece = DTensor.from_local(
            part,
            device_mesh=mesh,
            placements=placements,
            run_check=False,
            shape=torch.Size(global_shape),
            stride=torch.empty(global_shape, device="meta").stride(),
        )
        _gdn_attach_chunk(piece, [tp_rank * size + lo - row] + list(tail_offsets))
        pieces.append(piece)
        row += size
    return pieces


def _gdn_attach_chunk(dtensor, offsets):
    """Give DCP this rank's chunk, as Megatron-FSDP's uneven-DTensor metadata does, but computed locally."""
    from functools import partial

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunk = ChunkStorageMetadata(offsets=tuple(offsets), sizes=tuple(dtensor.to_local().shape))
    # partials of module-level functions, not closures: they pickle with the tensor if anyone does.
    dtensor._local_tensor.__create_chunk_list__ = partial(_gdn_chunk_list, chunk)
    dtensor._local_tensor.__create_write_items__ = partial(_gdn_write_items, chunk)


def _gdn_chunk_list(chunk):
    return [chunk]


def _gdn_write_items(chunk, fqn, tensor):
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = tensor.to_local()
    if local.numel() == 0:
        return []
    return [
        WriteItem(
            type=WriteItemType.SHARD,
            index=MetadataIndex(fqn, chunk.offsets),
            tensor_data=TensorWriteData(
                chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=tensor.size()
            ),
        )
    ]


# -- end of replacement ----------------------------------------------------------------------------
