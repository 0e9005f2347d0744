"""fsdp2-swiglu-split's monkeypatch on ``megatron.core.transformer.mlp``: ``MLP.sharded_state_dict``
wrapped, the probe and apply. Why: the package's docstring. Imported only when the target module is.

The wrapper calls the release's method and hands ``linear_fc1.weight`` / ``.bias`` to
:func:`_swiglu_factory_for_dtensor_shard` with their parameters, the same call the source diff
adds after the release's ``apply_swiglu_sharded_factory``. Every other key, and every factory the
helper does not recognise, is the release's.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import Group, in_scope, module_scope
from .. import ID, MODULE

# The names the replacement uses, as megatron/core/transformer/mlp.py binds them (set at apply).
ShardedTensor = ShardedTensorFactory = None

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/transformer/mlp.py, above class MLP.


def _swiglu_dtensor_rows(param, local_rows):
    """(first row, rows per mesh shard) of this rank's slice of a DTensor sharded along rows
    (dimension 0) on exactly one mesh dimension, every other placement Replicate; else None."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch before 2.5
        try:
            from torch.distributed._tensor import DTensor, Replicate, Shard
        except ImportError:
            return None
    if not isinstance(param, DTensor):
        return None
    mesh, placements = param.device_mesh, param.placements
    coordinate = mesh.get_coordinate()
    sharded = []
    for dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            if mesh.size(dim) > 1:
                sharded.append(dim)
        elif not isinstance(placement, Replicate):
            return None
    if coordinate is None or len(sharded) != 1:
        return None
    # torch's chunking of a Shard placement: ceil(n / mesh size) rows per shard, the last shorter.
    shard_rows = -(-param.shape[0] // mesh.size(sharded[0]))
    first_row = coordinate[sharded[0]] * shard_rows
    if first_row + local_rows > param.shape[0] or local_rows != min(shard_rows, param.shape[0] - first_row):
        return None
    return first_row, shard_rows


def _swiglu_tp_position(factory, total_rows, first_row):
    """The release's description of the DP shard (its ShardedTensor for W, which names the shard's
    index and count along the swiglu axis): (prepend offsets, TP rank, TP size), or None where it
    does not place the shard at ``first_row`` of a TP-local block of ``total_rows`` rows."""
    local_rows = factory.data.shape[0]
    try:
        built = factory.build_fn(factory.key, factory.data, factory.replica_id, None)
    except Exception:  # the release cannot build it either: keep its factory and its error
        return None
    if len(built) != 2 or built[0].key != factory.key or built[1].key != factory.key:
        return None  # singleton_local_shards (separate W and V keys): the release's
    w = built[0]
    axis = w.prepend_axis_num  # global offsets and fragments count the prepended axes, local_shape not
    frags = w.axis_fragmentations
    if frags is None or any(f != 1 for f in frags[axis + 1 :]) or w.local_shape[0] == 0:
        return None
    shard_index = w.global_offset[axis] // w.local_shape[0]
    offset, global_rows = shard_index * local_rows, frags[axis] // 2 * local_rows
    if global_rows % total_rows or offset % total_rows != first_row:
        return None
    prepend = tuple((i, w.global_offset[i], frags[i]) for i in range(axis))
    return prepend, offset // total_rows, global_rows // total_rows


def _swiglu_dtensor_shard_build_fn(layout, key, t, replica_id, flattened_range, release=None):
    """A DP shard of a TP-local [W; V] tensor as pieces of ``rows`` rows, each in its place in
    the global [W; V] (W of every TP rank, then V of every TP rank). The release's merge (a
    concatenation along rows, in this order) gives the shard back. ``release``: the build
    function this one replaces, kept to read checkpoints that were written with it."""
    prepend, tp_rank, tp_size, half, first_row, rows = layout
    assert flattened_range is None, "a flattened range of an FSDP2 SwiGLU shard"
    axis, fragments = len(prepend), 2 * tp_size * half // rows
    pieces = []
    for start in range(0, t.shape[0], rows):
        row = first_row + start  # in the TP-local [W; V]
        in_v = row >= half
        global_row = (tp_size * half if in_v else 0) + tp_rank * half + (row - half if in_v else row)
        pieces.append(
            ShardedTensor.from_rank_offsets(
                key,
                t[start : start + rows],
                *prepend,
                (axis, global_row // rows, fragments),
                replica_id=replica_id,
                prepend_axis_num=axis,
            )
        )
    return pieces


def _swiglu_factory_for_dtensor_shard(factory, param):
    """``factory`` (the release's ``apply_swiglu_sharded_factory`` of ``param``), with a build
    function that keeps W and V rows in their places where ``param`` is a DTensor whose rows are
    sharded (torch FSDP2): the release cuts the local DP shard in two as if it held half of W and
    half of V. Unchanged where it is not such a shard or its description is not recognised."""
    import dataclasses
    import functools
    import math

    if not isinstance(factory, ShardedTensorFactory) or factory.flattened_range is not None:
        return factory
    local_rows = factory.data.shape[0] if factory.data.dim() else 0
    found = _swiglu_dtensor_rows(param, local_rows) if local_rows else None
    total_rows = param.shape[0] if found is not None else 0
    if found is None or total_rows % 2:
        return factory
    first_row, shard_rows = found
    position = _swiglu_tp_position(factory, total_rows, first_row)
    if position is None:
        return factory
    prepend, tp_rank, tp_size = position
    half = total_rows // 2
    # One piece size on every rank: every shard boundary (multiples of shard_rows, and the end) and
    # the W/V boundary fall on it, so no piece spans W and V.
    rows = math.gcd(shard_rows, half)
    layout = (prepend, tp_rank, tp_size, half, first_row, rows)
    build_fn = functools.partial(_swiglu_dtensor_shard_build_fn, layout, release=factory.build_fn)
    return dataclasses.replace(factory, build_fn=build_fn)


# -- end of replacement ---


def bind_mapping_globals():
    """The replacement section's globals, as megatron/core/transformer/mlp.py has them."""
    global ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


def _release_method(cls):
    return original(cls, "sharded_state_dict")  # the release's, even after apply


@layer(ID, MODULE, "sharded_state_dict", owner="MLP")
def mlp_sharded_state_dict(below_us, self, prefix="", sharded_offsets=(), metadata=None):
    """``MLP.sharded_state_dict``: the release's, its SwiGLU ``linear_fc1`` factories of FSDP2
    shards given their place in [W; V]."""
    out = below_us(self, prefix, sharded_offsets, metadata)
    if getattr(self.config, "gated_linear_unit", False):
        fc1 = self._modules.get("linear_fc1")
        for name in ("weight", "bias"):
            key = f"{prefix}linear_fc1.{name}"
            if key in out:
                out[key] = _swiglu_factory_for_dtensor_shard(out[key], getattr(fc1, name, None))
    return out


# -- probe: the release's MLP.sharded_state_dict on a stand-in layer (no world, no collective) ----

PROBE_ROWS = 4  # TP-local [W; V], TP=1: W rows 0-1, V rows 2-3; this rank holds DP shard 1 of 2


def _probe_mesh():
    """A 2-rank CPU DeviceMesh on which this process is rank 1, built without process groups."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    try:
        return DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=1)
    except TypeError:  # older torch: no _rank; the mesh asks get_rank() for this rank's coordinate
        import torch.distributed.device_mesh as dm

        saved = dm.__dict__.get("get_rank")
        dm.get_rank = lambda *args, **kwargs: 1
        try:
            return DeviceMesh("cpu", torch.arange(2), _init_backend=False)
        finally:
            dm.get_rank = saved


def _probe_layer(module):
    """An MLP (the release's class, its __init__ skipped) whose linear_fc1 holds a (4, 1) DTensor
    Shard(0) over 2 ranks and describes it as the release's helper does under FSDP2 (TP=1, DP=2:
    shard 1 of 2, tagged as Megatron's FSDP2 wrapper tags it)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        from torch.distributed._tensor import DTensor, Shard

    class Linear(torch.nn.Module):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            local = self.weight._local_tensor
            sh = ShardedTensor.from_rank_offsets(
                f"{prefix}weight",
                local,
                *sharded_offsets,
                (len(sharded_offsets), 1, 2),
                replica_id=(0, 0, 0),
                prepend_axis_num=len(sharded_offsets),
            )
            sh.is_torch_fsdp2_param = True
            return {f"{prefix}weight": sh}

    local = torch.arange(2.0, 4.0).unsqueeze(1)  # rows 2-3: V
    fc1 = Linear()
    fc1.weight = torch.nn.Parameter(DTensor.from_local(local, _probe_mesh(), [Shard(0)], run_check=False))
    fc1.weight.is_torch_fsdp2_param = True
    layer = object.__new__(module.MLP)
    torch.nn.Module.__init__(layer)
    layer.config = types.SimpleNamespace(gated_linear_unit=True)
    layer.tp_group = Group(rank=0, size=1)
    layer.linear_fc1 = fc1
    return layer


def _groups_read_from_stand_ins(module):
    """The module's ``get_pg_rank`` / ``get_pg_size`` (0.19's factory reads the DP group's size with
    them) reading a stand-in group's ``rank()`` / ``size()``: Megatron's answer 1 for every group
    outside an initialised world would hide its DP-shard branch."""
    names = {
        "get_pg_rank": lambda group=None: 0 if group is None else group.rank(),
        "get_pg_size": lambda group=None: 1 if group is None else group.size(),
    }
    return {n: f for n, f in names.items() if n in module.__dict__}


def global_rows_written(module):
    """The global [W; V] row each local row of the probe's shard is written to (right: [2, 3]); the
    release's method and factory run in a copy of the module's globals (the live module is left as
    it is)."""
    layer = _probe_layer(module)
    method = in_scope(_release_method(module.MLP), module_scope(module, **_groups_read_from_stand_ins(module)))
    factory = method(layer, "", (), {"dp_cp_group": Group(rank=1, size=2)})["linear_fc1.weight"]
    built = factory.build_fn(factory.key, factory.data, factory.replica_id, factory.flattened_range)
    return [int(sh.global_offset[0]) + i for sh in built for i in range(sh.local_shape[0])]


def probe(module: types.ModuleType):
    if not hasattr(module, "MLP") or not hasattr(module, "apply_swiglu_sharded_factory"):
        return None, f"{MODULE} has no MLP with a SwiGLU sharded factory"
    try:
        from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
    except ImportError:
        return None, "this torch has no DeviceMesh (no FSDP2)"
    rows = global_rows_written(module)
    if rows == [2, 3]:
        return False, "a DP shard of an FSDP2 SwiGLU linear_fc1 is written where its rows belong"
    return True, (
        f"rows 2-3 (V) of a (4, 1) FSDP2 SwiGLU linear_fc1, DP shard 1 of 2, are written to global rows {rows}: "
        "apply_swiglu_sharded_factory splits the DP shard as if it held half of W and half of V"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    from . import layout

    bind_mapping_globals()
    patcher.replace(module.MLP, "sharded_state_dict", mlp_sharded_state_dict)
    layout.apply(patcher)
