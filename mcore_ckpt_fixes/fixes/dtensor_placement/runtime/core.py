"""dtensor-placement's monkeypatch: the layout of a DTensor from its own mesh and placements
(:func:`dtensor_layout`), the replacement helpers and ``SequentialMLP.sharded_state_dict``, and the
probes that run the release's own code on a tiny DTensor. Imported only when a target module is;
the declaration and why are in the package's docstring (:mod:`mcore_ckpt_fixes.fixes.dtensor_placement`).
"""

from __future__ import annotations

import sys
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, has_layer, is_replacement, original
from ....engine.probing import Group, in_scope, module_scope
from .. import EXPERTS, ID, UTILS
from . import shard

TP_HELPER = "make_tp_sharded_tensor_for_checkpoint"
HELPER = "make_sharded_tensor_for_checkpoint"
# Set on a ShardedTensor described from a sharded DTensor: the DP component of its replica id, which
# SequentialMLP must not overwrite with the expert-DP rank.
REPLICA_ATTR = "_mcore_ckpt_fixes_dtensor_replica"
FSDP2_TAG = "is_torch_fsdp2_param"  # Megatron's own marker (its FSDP2 wrapper, 0.19's helpers)

# helper name -> True when the release's helper only takes its DTensor branch for tagged DTensors.
TAG_REQUIRED: dict = {}
# helper name -> True when the release's helper takes tp_group / dp_cp_group (0.16+).
_TAKES_GROUPS: dict = {}


class DTensorPlacementError(ValueError):
    """A DTensor layout that dist_checkpointing cannot describe."""


# -- the layout, from the DTensor alone ----------------------------------------------------------


class Layout:
    """Where a DTensor's local shard lies in its global tensor, from its mesh and placements."""

    __slots__ = ("global_shape", "offset", "local_shape", "replica", "even", "sharded")

    def __init__(self, global_shape, offset, local_shape, replica, even, sharded):
        self.global_shape, self.offset, self.local_shape = global_shape, offset, local_shape
        self.replica, self.even, self.sharded = replica, even, sharded

    def __repr__(self):
        return (
            f"Layout(global_shape={self.global_shape}, offset={self.offset}, local_shape={self.local_shape}, "
            f"replica={self.replica}, even={self.even})"
        )


def dtensor_layout(tensor, key="<tensor>") -> Layout:
    """The local shard's global offset, the global shape, the replica index and evenness.

    Shard(d) on mesh dim i cuts the current extent of tensor dim d into ``mesh.shape[i]`` torch
    chunks (mesh dims in order, so two Shard(d) nest as torch nests them); Replicate dims give the
    replica index (row-major over those dims; 0 is the main replica). Reads only the mesh's
    coordinate and shape: no process group is touched.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    coord = mesh.get_coordinate()
    if coord is None:
        raise DTensorPlacementError(
            f"{key}: this rank is not in the DTensor's device mesh; accepted: a DTensor whose mesh includes this rank"
        )
    mesh_shape = tuple(mesh.shape)
    global_shape = tuple(tensor.shape)
    ndim = len(global_shape)
    offset, extent = [0] * ndim, list(global_shape)
    replica, even, sharded = 0, True, False
    for i, p in enumerate(placements):
        n = mesh_shape[i]
        if type(p) is Replicate:
            replica = replica * n + coord[i]
        elif type(p) is Shard:
            d = p.dim % ndim
            size = extent[d]
            chunk = -(-size // n) if size else 0
            start = min(coord[i] * chunk, size)
            offset[d] += start
            extent[d] = max(0, min(chunk, size - start))
            even = even and size % n == 0
            sharded = sharded or n > 1
        else:
            raise DTensorPlacementError(
                f"{key}: cannot checkpoint a DTensor placed {p!r} on mesh dim {i}; accepted: Shard(dim), Replicate()"
            )
    local_shape = tuple(tensor._local_tensor.shape)
    if tuple(extent) != local_shape:
        raise DTensorPlacementError(
            f"{key}: local shard {local_shape} does not match placements {placements} of global shape "
            f"{global_shape} (expected {tuple(extent)}); accepted: torch's Shard chunking (ceil(n/mesh) per shard)"
        )
    return Layout(global_shape, tuple(offset), local_shape, replica, even, sharded)


def _is_dtensor(tensor) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(tensor, cls)


def _takes_dtensor_branch(helper: str, tensor) -> bool:
    if not _is_dtensor(tensor):
        return False
    return not TAG_REQUIRED.get(helper, False) or hasattr(tensor, FSDP2_TAG)


def takes_groups(helper) -> bool:
    """Does the release's helper take its groups as arguments (0.16+: ``tp_group`` / ``dp_cp_group``
    keywords) rather than reading ``parallel_state`` (0.12-0.15)?"""
    return "dp_cp_group" in helper.__code__.co_consts


def _groups(helper, kwargs):
    """(tp_rank, tp_size, kwargs without the groups) as the release's ``helper`` finds them: the
    groups from kwargs, with a fallback to parallel_state when both are None; 0.12-0.15 read
    parallel_state only. ``kwargs`` itself is left as it is (the plain path hands it on)."""
    utils = sys.modules[UTILS]
    rest = {k: v for k, v in kwargs.items() if k not in ("tp_group", "dp_cp_group")}
    if not _TAKES_GROUPS.get(helper, True):
        ps = utils.parallel_state
        return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), rest
    tp_group = kwargs.get("tp_group")
    if tp_group is None and kwargs.get("dp_cp_group") is None:
        tp_group = utils.parallel_state.get_tensor_model_parallel_group()
    return utils.get_pg_rank(tp_group), utils.get_pg_size(tp_group), rest


def build_sharded_tensor(key, tensor, prepend_offsets, tp_axis, tp_rank, tp_size, replica_id, kwargs):
    """The ShardedTensor of a sharded DTensor's local shard (``tp_axis=None``: not TP-sharded), by the
    helper the source diff inserts into ``megatron/core/utils.py`` (:mod:`.shard`), run here."""
    try:
        sh, _ = shard._dtensor_shard_for_checkpoint(
            tensor, key, prepend_offsets, tp_axis, tp_rank, tp_size, 0, replica_id, kwargs
        )
    except ValueError as exc:
        if not str(exc).startswith(f"{key}: "):
            raise
        raise DTensorPlacementError(str(exc)) from None  # its one-line refusals, as this fix's error
    return sh


# -- replacements (plain module-level functions: picklable by reference) ------------------------


def _stale(name, me):
    """What ``megatron.core.utils`` binds now when that is not this replacement, else None.

    A module imported while the fix was applied binds the replacement by ``from ... import``; the
    engine's revert only restores the bindings it made itself. Such a stale binding forwards to
    the current one, so a reverted fix behaves as reverted everywhere.
    """
    utils = sys.modules[UTILS]
    if has_layer(ID, utils, name):  # in place (another fix's layer may be on top: it called us)
        return None
    current = utils.__dict__.get(name)
    return None if current is me else current


@layer(ID, UTILS, TP_HELPER)
def make_tp_sharded_tensor_for_checkpoint(
    below_us, tensor, key, tp_axis=0, replica_id=None, prepend_offsets=(), **kwargs
):
    stale = _stale(TP_HELPER, make_tp_sharded_tensor_for_checkpoint)
    if stale is not None:
        return stale(tensor, key, tp_axis, replica_id, prepend_offsets, **kwargs)
    if not _takes_dtensor_branch(TP_HELPER, tensor):
        return below_us(tensor, key, tp_axis, replica_id, prepend_offsets, **kwargs)
    layout = dtensor_layout(tensor, key)
    ours = replica_id is None
    if ours:  # the DTensor's mesh holds every copy of its data: it says who writes, not the dense group
        replica_id = (0, 0, layout.replica)
    if layout.sharded:
        tp_rank, tp_size, rest = _groups(TP_HELPER, kwargs)
        sh = build_sharded_tensor(key, tensor, prepend_offsets, tp_axis, tp_rank, tp_size, replica_id, rest)
    else:  # all Replicate / size-1 mesh: the plain path, on the local (= full) tensor
        sh = below_us(tensor._local_tensor, key, tp_axis, replica_id, prepend_offsets, **kwargs)
    if ours:
        setattr(sh, REPLICA_ATTR, layout.replica)
    return sh


@layer(ID, UTILS, HELPER)
def make_sharded_tensor_for_checkpoint(below_us, tensor, key, prepend_offsets=(), replica_id=None, **kwargs):
    stale = _stale(HELPER, make_sharded_tensor_for_checkpoint)
    if stale is not None:
        return stale(tensor, key, prepend_offsets, replica_id, **kwargs)
    if not _takes_dtensor_branch(HELPER, tensor):
        return below_us(tensor, key, prepend_offsets, replica_id, **kwargs)
    layout = dtensor_layout(tensor, key)
    ours = replica_id is None
    if ours or layout.sharded:
        tp_rank, _, rest = _groups(HELPER, kwargs)
    if ours:  # replicated across TP as the release says; across DP as the DTensor's own mesh says
        replica_id = (0, tp_rank, layout.replica)
    if layout.sharded:
        sh = build_sharded_tensor(key, tensor, prepend_offsets, None, 0, 1, replica_id, rest)
    else:  # all Replicate / size-1 mesh: never materialise, the local tensor is the full one
        sh = below_us(tensor._local_tensor, key, prepend_offsets, replica_id, **kwargs)
    if ours:
        setattr(sh, REPLICA_ATTR, layout.replica)
    return sh


@layer(ID, EXPERTS, "sharded_state_dict", owner="SequentialMLP")
def sequential_mlp_sharded_state_dict(below_us, self, prefix="", sharded_offsets=(), metadata=None):
    """SequentialMLP's, with the DP replica index of DTensor-described expert shards kept."""
    out = below_us(self, prefix, sharded_offsets, metadata)
    for sh in out.values():
        dp_replica = getattr(sh, REPLICA_ATTR, None)
        if dp_replica is not None and isinstance(sh.replica_id, tuple) and len(sh.replica_id) == 3:
            sh.replica_id = (*sh.replica_id[:2], dp_replica)
    return out


# -- probes: the release's own code on a tiny DTensor over a mesh without process groups ---------


class _ParallelState:
    """Stands in for ``megatron.core.parallel_state`` in a probe of a release whose helpers read it
    (0.12-0.15): fixed (rank, size) per group, nothing initialised or communicated."""

    def __init__(self, tp=(0, 1), dp=(3, 4), ep=(0, 1), edp=(1, 2)):
        self._g = {"tp": tp, "dp": dp, "ep": ep, "edp": edp}

    def _rank(self, g):
        return lambda *a, **k: self._g[g][0]

    def _size(self, g):
        return lambda *a, **k: self._g[g][1]

    def _group(self, g):
        return lambda *a, **k: Group(rank=self._g[g][0], size=self._g[g][1])

    def __getattr__(self, name):
        for g, word in (
            ("edp", "expert_data_parallel"),
            ("ep", "expert_model_parallel"),
            ("tp", "tensor_model_parallel"),
            ("dp", "data_parallel"),
        ):
            if f"get_{word}_" in name:
                kind = "rank" if name.endswith("_rank") else "size" if name.endswith("world_size") else "group"
                return getattr(self, f"_{kind}")(g)
        raise AttributeError(name)


def _call_helper(module, name, tensor, tp=(0, 1), dp=(3, 4)):
    """The release's helper ``name`` (whatever the module binds now) called as ``(tensor, "probe")``
    with this rank at ``tp`` / ``dp`` (rank, size), however it finds its groups: as arguments (0.16+)
    or from parallel_state (0.12-0.15). It runs in a copy of the module's globals in which both
    helpers are the release's (the live module is left as it is)."""
    releases = {helper: original(module, helper) for helper in (TP_HELPER, HELPER)}
    release = releases[name]
    if takes_groups(release):
        scope = module_scope(module, **releases)
        groups = {"tp_group": Group(rank=tp[0], size=tp[1]), "dp_cp_group": Group(rank=dp[0], size=dp[1])}
        return in_scope(release, scope)(tensor, "probe", **groups)
    scope = module_scope(module, parallel_state=_ParallelState(tp=tp, dp=dp), **releases)
    return in_scope(release, scope)(tensor, "probe")


def probe_dtensor(tag=True):
    """Shard 1 of a (4, 3) tensor Shard(0) over a 2-rank mesh: rows 2-3. A real DeviceMesh built
    without process groups (``_init_backend=False``): nothing is initialised or communicated."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    try:
        mesh = DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=1)
    except TypeError:  # older torch (2.6): no _rank; the mesh asks get_rank() for this rank's coordinate
        import torch.distributed.device_mesh as dm

        saved = dm.__dict__.get("get_rank")
        dm.get_rank = lambda *args, **kwargs: 1
        try:
            mesh = DeviceMesh("cpu", torch.arange(2), _init_backend=False)
        finally:
            dm.get_rank = saved
    dt = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False)
    if tag:
        setattr(dt, FSDP2_TAG, True)
    return dt


def _described_right(sh) -> bool:
    return tuple(sh.global_shape) == (4, 3) and tuple(sh.global_offset) == (2, 0)


def probe_utils(module: types.ModuleType):
    if not hasattr(module, TP_HELPER) or not hasattr(module, HELPER):
        return None, f"megatron.core.utils lacks {TP_HELPER} or {HELPER}"
    if not getattr(module, "HAVE_DTENSOR", True):
        return None, "this torch has no DTensor"
    # The dense DP group says rank 3 of 4 (what a dense DP group around a 2-rank expert mesh says).
    wrong = []
    tp_sh = _call_helper(module, TP_HELPER, probe_dtensor())
    if not _described_right(tp_sh):
        wrong.append(f"{TP_HELPER} gives global {tuple(tp_sh.global_shape)} offset {tuple(tp_sh.global_offset)}")
    sh = _call_helper(module, HELPER, probe_dtensor())
    if not _described_right(sh):
        wrong.append(f"{HELPER} gives global {tuple(sh.global_shape)} offset {tuple(sh.global_offset)}")
    if wrong:
        return True, "rows 2-3 of a (4, 3) DTensor Shard(0) on a 2-rank mesh: " + "; ".join(wrong)
    return False, "DTensor offsets and global shape come from its mesh and placements"


def _tag_required(module, name) -> bool:
    """Does the release's helper skip its DTensor branch for an untagged DTensor? (0.19 does.)"""
    sh = _call_helper(module, name, probe_dtensor(tag=False), dp=(0, 1))
    return _is_dtensor(sh.data)


def probe_sequential_mlp(module: types.ModuleType):
    if not hasattr(module, "SequentialMLP"):
        return None, "megatron.core.transformer.moe.experts has no SequentialMLP"
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    class Expert(torch.nn.Module):
        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            sh = ShardedTensor.from_rank_offsets(
                f"{prefix}w",
                torch.zeros(1),
                *sharded_offsets,
                replica_id=(0, 0, 0),
                prepend_axis_num=len(sharded_offsets),
            )
            setattr(sh, FSDP2_TAG, True)
            return {f"{prefix}w": sh}

    stub = torch.nn.Module()
    stub.local_experts = torch.nn.ModuleList([Expert()])
    stub.num_local_experts, stub.ep_group, stub.dp_group = 1, Group(rank=0, size=1), Group(rank=1, size=2)
    # 0.13-0.15 wrap it in expert_dist_ckpt_decorator, which swaps parallel_state's TP group for the
    # expert one (an initialised world only): call what it wraps. 0.12 reads the expert ranks from
    # parallel_state; later releases from the module's groups.
    fn = module.SequentialMLP.__dict__["sharded_state_dict"]
    if is_replacement(fn):
        fn = original(module.SequentialMLP, "sharded_state_dict")  # re-probed after apply: judge the release's
    fn = getattr(fn, "__wrapped__", fn)
    # In a copy of the module's globals with a stand-in parallel_state: the live module is left as it is.
    fn = in_scope(fn, module_scope(module, parallel_state=_ParallelState(ep=(0, 1), edp=(1, 2))))
    out = fn(stub, "", (), {"dp_cp_group": Group(rank=1, size=2)})
    (sh,) = out.values()
    if sh.replica_id[-1] == 0:
        return False, "SequentialMLP keeps the DP replica index of DTensor-described expert shards"
    return (
        True,
        "SequentialMLP overwrites the DP replica index of DTensor-described expert shards with the expert-DP rank",
    )


# -- apply ---------------------------------------------------------------------------------------


def apply_utils(module: types.ModuleType, patcher: Patcher) -> None:
    shard.bind(module)
    for name in (TP_HELPER, HELPER):
        _TAKES_GROUPS[name] = takes_groups(original(module, name))
        TAG_REQUIRED[name] = _tag_required(module, name)
    patcher.replace_function(module, TP_HELPER, make_tp_sharded_tensor_for_checkpoint)
    patcher.replace_function(module, HELPER, make_sharded_tensor_for_checkpoint)


def apply_sequential_mlp(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.SequentialMLP, "sharded_state_dict", sequential_mlp_sharded_state_dict)
