"""dtensor-placement: both halves on every release line (0.16-0.19 are all affected), real
Megatron-Core layers sharded with torch's own ``fully_shard`` on a CPU DeviceMesh (gloo), real
dist_checkpointing save/load; plus unit tests of the layout computation, bad input and rebinding.

No stand-ins: MoELayer / SequentialMLP / MLP, FSDP2 and dist_checkpointing are the real ones.
Megatron's ``TorchFullyShardedDataParallel`` is not called (it hard-codes a CUDA mesh); the
scenarios do what it does around ``fully_shard`` (see mcore_ckpt_fixes/fixes/dtensor_placement/checks/core.py).
"""

import pytest
import torch

from conftest import check_py
from mcore_ckpt_fixes.engine.probing import Group
from mcore_ckpt_fixes.fixes.dtensor_placement import FIX
from mcore_ckpt_fixes.fixes.dtensor_placement.runtime import core as dp
from mcore_ckpt_fixes.fixes.dtensor_placement.checks.scenarios import DTP_TP_FSDP
from mcore_ckpt_fixes.testing import for_fix
from mcore_ckpt_fixes.testing.launcher import run_world, values

SCENARIOS = {s.name: s for s in for_fix(FIX.id)}
EXPERT_KEYS = [f"experts.experts.linear_fc{i}.{p}" for i in (1, 2) for p in ("bias", "weight")]


HELPER_KEYS = sorted(
    name
    for name, _, _ in __import__("mcore_ckpt_fixes.fixes.dtensor_placement.checks.core", fromlist=["x"]).HELPER_CASES
)


def test_registry_declares_every_round_trip(mcore_version):
    """The documented errors on this release, pinned: the unpatched tests compare the worlds with the
    registry's (the form of every fix's registry: tests/fixes/test_every_fix.py)."""
    bugs = {n: s.bug_for(mcore_version) for n, s in SCENARIOS.items()}
    assert {n: (bugs[n].kind, bugs[n].phase, bugs[n].error) for n in SCENARIOS} == {
        "ep2_helpers": (
            "raises",
            "validate",
            "CheckpointingException: Invalid access pattern for " + ", ".join(HELPER_KEYS),
        ),
        "moe_ep": (
            "raises",
            "validate",
            "CheckpointingException: Invalid access pattern for " + ", ".join(EXPERT_KEYS),
        ),
        "hsdp": (
            "raises",
            "load_unsharded",
            "CheckpointingException: Global shape mismatch for loaded (torch.Size([24, 8])) and expected "
            "((12, 8)) tensor for key linear_fc1.weight",
        ),
    }


@pytest.fixture(scope="module", autouse=True)
def warm_parent():
    from mcore_ckpt_fixes.fixes.dtensor_placement.checks.core import prepare

    prepare()


def _run(func, nproc, patched, tmp_path):
    env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
    return values(run_world(func, nproc, {"ckpt_dir": str(tmp_path), "patched": patched}, env=env, timeout=180))


def _exact(results, state="applied"):
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert set(r["fix_state"].values()) == {state}, (rank, r["fix_state"])


def test_status_applied(mcore_version):
    import mcore_ckpt_fixes
    import megatron.core.transformer.moe.experts  # noqa: F401
    import megatron.core.utils as mu

    assert mcore_version in FIX.specifiers  # every tested line is affected
    row = next(r for r in mcore_ckpt_fixes.report() if r["id"] == FIX.id)
    assert row["state"] == "applied", row
    assert set(row["targets"]) == {dp.UTILS, dp.EXPERTS}
    assert "offset (0, 0)" in row["targets"][dp.UTILS]["reason"]
    assert mu.make_tp_sharded_tensor_for_checkpoint is dp.make_tp_sharded_tensor_for_checkpoint
    # 0.19 enters the DTensor branch only for tensors Megatron's FSDP2 wrapper tagged; the fix keeps that.
    assert dp.TAG_REQUIRED == dict.fromkeys((dp.TP_HELPER, dp.HELPER), mcore_version.release[:2] >= (0, 19))


# -- round trips -------------------------------------------------------------------------------


def test_moe_ep_unpatched_save_rejected(tmp_path, mcore_version):
    results = _run(SCENARIOS["moe_ep"].func, 4, False, tmp_path)
    bug = SCENARIOS["moe_ep"].bug_for(mcore_version)
    for rank, r in enumerate(results):
        assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r["error"])
        # Megatron's own message: dense-DP offsets (4 chunks of an expert tensor that has 2).
        assert "Invalid access pattern for ShardedTensor(key='experts.experts.linear_fc1.bias'" in r["raw_error"]
        assert "global_shape=(4, 24)" in r["raw_error"], r["raw_error"][:600]
    assert bug.seen_in(results)


def test_moe_ep_patched_exact(tmp_path):
    results = _run(SCENARIOS["moe_ep"].func, 4, True, tmp_path)
    _exact(results)
    for r in results:  # every expert tensor and the router, per rank
        assert {k.rsplit(".", 1)[0].split("local_experts.")[-1] for k in r["max_delta"]} >= {
            "0.linear_fc1",
            "1.linear_fc2",
            "router",
        }
        assert len(r["max_delta"]) == 10


def test_hsdp_unpatched_silent_in_place_wrong_on_disk(tmp_path):
    results = _run(SCENARIOS["hsdp"].func, 4, False, tmp_path)
    bug = SCENARIOS["hsdp"].bug_for(None)
    for rank, r in enumerate(results):
        assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r["phase"], r["error"])
        # Same layout: each rank reads back what it wrote, so nothing looks wrong until another
        # layout reads the doubled global shape.
        assert len(r["max_delta"]) == 4 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
    assert bug.seen_in(results)


def test_hsdp_patched_exact_in_place_and_unsharded(tmp_path):
    results = _run(SCENARIOS["hsdp"].func, 4, True, tmp_path)
    _exact(results)
    for r in results:
        assert sum(k.startswith("unsharded/") for k in r["max_delta"]) == 4


def test_ep2_helpers_unpatched_save_rejected(tmp_path):
    """EP=2 on two ranks, each rank's expert DTensor on its size-1 expert-DP mesh, the helpers handed
    the dense DP group: dense-DP offsets (a (2, 8, 3) tensor, 2 x 2 chunks for 2 writers) for every case."""
    scenario = SCENARIOS["ep2_helpers"]
    results = _run(scenario.func, 2, False, tmp_path)
    for rank, r in enumerate(results):
        assert (r["phase"], r["error"]) == (scenario.bug.phase, scenario.bug.error), (rank, r["phase"], r["error"])
        # Megatron's message: the dense group's 2 chunks of rows per expert where each rank holds one.
        assert "global_shape=(2, 8, 3)" in r["raw_error"] and "axis_fragmentations=(2, 2, 1)" in r["raw_error"], r[
            "raw_error"
        ][:800]
    assert scenario.bug.seen_in(results)


def test_ep2_helpers_patched_every_rank_loads_its_own_expert(tmp_path):
    results = _run(SCENARIOS["ep2_helpers"].func, 2, True, tmp_path)
    _exact(results)
    for r in results:
        assert sorted(r["max_delta"]) == HELPER_KEYS


@pytest.mark.parametrize("patched", [False, True], ids=["unpatched", "patched"])
def test_tp_fsdp_exact_either_way(patched, tmp_path):
    """TP=2 + FSDP2 on the TP-sharded axis: the layout upstream already handles keeps working."""
    _exact(_run(DTP_TP_FSDP, 2, patched, tmp_path), "applied" if patched else "disabled")


# -- the layout computation, without a process group --------------------------------------------


def _dt(global_shape, mesh_shape, coord, placements, local_shape=None):
    """A real DTensor on a real DeviceMesh built without process groups, as this rank ``coord``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    n = 1
    for s in mesh_shape:
        n *= s
    ranks = torch.arange(n).reshape(mesh_shape)
    rank = int(ranks[tuple(coord)])
    mesh = DeviceMesh("cpu", ranks, _init_backend=False, _rank=rank)
    local = torch.arange(float(torch.Size(local_shape).numel())).reshape(local_shape)
    stride = torch.empty(global_shape).stride()
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(global_shape), stride=stride)
    dt.is_torch_fsdp2_param = True
    return dt


def test_layout_even_uneven_empty_and_nested():
    from torch.distributed.tensor import Replicate, Shard

    lay = dp.dtensor_layout(_dt((4, 3), (2,), (1,), [Shard(0)], (2, 3)))
    assert (lay.offset, lay.global_shape, lay.replica, lay.even) == ((2, 0), (4, 3), 0, True)
    lay = dp.dtensor_layout(_dt((5, 3), (2,), (1,), [Shard(0)], (2, 3)))  # torch chunks 3 + 2
    assert (lay.offset, lay.even) == ((3, 0), False)
    lay = dp.dtensor_layout(_dt((2, 3), (4,), (3,), [Shard(0)], (0, 3)))  # chunks 1, 1, 0, 0
    assert (lay.offset, lay.local_shape, lay.even) == ((2, 0), (0, 3), False)
    lay = dp.dtensor_layout(_dt((4, 6), (2,), (1,), [Shard(1)], (4, 3)))
    assert lay.offset == (0, 3)
    lay = dp.dtensor_layout(_dt((8, 3), (2, 2), (1, 1), [Shard(0), Shard(0)], (2, 3)))  # nested: 4 + 2
    assert lay.offset == (6, 0)
    lay = dp.dtensor_layout(_dt((4, 3), (2, 2), (1, 0), [Replicate(), Shard(0)], (2, 3)))  # HSDP
    assert (lay.offset, lay.replica, lay.sharded) == ((0, 0), 1, True)
    lay = dp.dtensor_layout(_dt((4, 3), (2,), (1,), [Replicate()], (4, 3)))
    assert (lay.replica, lay.sharded) == (1, False)


def test_fixed_helpers_merge_tp_offsets(monkeypatch):
    from torch.distributed.tensor import Replicate, Shard

    import megatron.core.utils as mu

    tp = Group(rank=1, size=2)
    dp_group = Group(rank=3, size=4)  # the dense DP group's claim: ignored for the DTensor's own placement
    dt = _dt((4, 3), (2,), (1,), [Shard(0)], (2, 3))
    uneven = _dt((5, 3), (2,), (1,), [Shard(0)], (2, 3))
    hsdp = _dt((4, 3), (2, 2), (1, 0), [Replicate(), Shard(0)], (2, 3))
    # The release's get_pg_rank/get_pg_size ask the groups only inside an initialised world.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    # TP on the same axis: TP rank 1's block of 4 rows, then rows 2-3 of it.
    sh = mu.make_tp_sharded_tensor_for_checkpoint(dt, "k", 0, tp_group=tp, dp_cp_group=dp_group)
    assert (sh.global_shape, sh.global_offset, sh.axis_fragmentations, sh.replica_id) == (
        (8, 3),
        (6, 0),
        (4, 1),
        (0, 0, 0),
    )
    assert sh.data is dt._local_tensor and sh.is_torch_fsdp2_param
    # TP on another axis, with a prepended expert axis.
    sh = mu.make_tp_sharded_tensor_for_checkpoint(
        dt, "k", 1, prepend_offsets=((0, 3, 4),), tp_group=tp, dp_cp_group=dp_group
    )
    assert (sh.global_shape, sh.global_offset) == ((4, 4, 6), (3, 2, 3))
    # Replicated across TP: the replica id keeps the TP rank.
    sh = mu.make_sharded_tensor_for_checkpoint(dt, "k", tp_group=tp, dp_cp_group=dp_group)
    assert (sh.global_shape, sh.global_offset, sh.replica_id) == ((4, 3), (2, 0), (0, 1, 0))
    # Uneven: an irregular grid, described exactly.
    sh = mu.make_sharded_tensor_for_checkpoint(uneven, "u", tp_group=tp, dp_cp_group=dp_group)
    assert (sh.global_shape, sh.global_offset, sh.axis_fragmentations) == ((5, 3), (3, 0), None)
    # HSDP: replica index from the Replicate dim.
    sh = mu.make_sharded_tensor_for_checkpoint(hsdp, "h", tp_group=tp, dp_cp_group=dp_group)
    assert (sh.global_offset, sh.replica_id) == ((0, 0), (0, 1, 1))


def test_all_replicate_takes_the_plain_path_without_gathering(monkeypatch):
    from torch.distributed.tensor import DTensor, Replicate

    import megatron.core.utils as mu

    dt = _dt((4, 3), (2,), (1,), [Replicate()], (4, 3))
    monkeypatch.setattr(DTensor, "full_tensor", lambda self, **kw: pytest.fail("materialised"))
    # Without an initialised process group the release's get_pg_rank says 0 for any group.
    sh = mu.make_sharded_tensor_for_checkpoint(
        dt, "r", tp_group=Group(rank=0, size=1), dp_cp_group=Group(rank=1, size=2)
    )
    want = dp.original(mu, dp.HELPER)(
        dt._local_tensor, "r", tp_group=Group(rank=0, size=1), dp_cp_group=Group(rank=1, size=2)
    )
    assert sh.data is dt._local_tensor
    assert (sh.global_shape, sh.global_offset) == (want.global_shape, want.global_offset)
    # The replica index is the rank's coordinate on the DTensor's own mesh (1 here), not the dense group's.
    assert sh.replica_id == (0, 0, 1) and getattr(sh, dp.REPLICA_ATTR) == 1


@pytest.mark.parametrize("placement", ["shard0", "replicate"])
@pytest.mark.parametrize("helper", [dp.TP_HELPER, dp.HELPER])
def test_size1_mesh_is_the_main_replica_whatever_dense_group(helper, placement, monkeypatch):
    """The seed case at EP=2 on two ranks: an expert DTensor on this rank's size-1 expert-DP mesh is
    its only copy, so it is the main replica even though the dense DP group says rank 1 of 2."""
    from torch.distributed.tensor import Replicate, Shard

    import megatron.core.utils as mu

    dt = _dt((4, 3), (1,), (0,), [Shard(0) if placement == "shard0" else Replicate()], (4, 3))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    groups = dict(tp_group=Group(rank=0, size=1), dp_cp_group=Group(rank=1, size=2))
    if helper == dp.TP_HELPER:
        sh = mu.make_tp_sharded_tensor_for_checkpoint(dt, "e", 0, prepend_offsets=((0, 1, 2),), **groups)
    else:
        sh = mu.make_sharded_tensor_for_checkpoint(dt, "e", prepend_offsets=((0, 1, 2),), **groups)
    assert (sh.global_shape, sh.global_offset, sh.replica_id) == ((2, 4, 3), (1, 0, 0), (0, 0, 0))
    assert sh.data is dt._local_tensor
    # A replica id the caller passes is kept as given.
    if helper == dp.HELPER:
        sh = mu.make_sharded_tensor_for_checkpoint(
            dt, "e", prepend_offsets=((0, 1, 2),), replica_id=(0, 0, 5), **groups
        )
        assert sh.replica_id == (0, 0, 5)


def test_bad_placement_is_one_clear_line():
    from torch.distributed.tensor import Partial

    import megatron.core.utils as mu

    dt = _dt((4, 3), (2,), (1,), [Partial()], (4, 3))
    with pytest.raises(dp.DTensorPlacementError) as info:
        mu.make_sharded_tensor_for_checkpoint(
            dt, "decoder.w", tp_group=Group(rank=0, size=1), dp_cp_group=Group(rank=1, size=2)
        )
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("decoder.w: cannot checkpoint a DTensor placed Partial")
    assert msg.endswith("accepted: Shard(dim), Replicate()")


# -- rebinding ---------------------------------------------------------------------------------


@pytest.mark.one_line  # the engine's rebinding, reload, pickle and revert, which tests/engine/test_lifecycle.py checks for every fix on every line
def test_modules_that_bound_the_helpers_before_the_fix_get_the_fixed_ones():
    check_py(
        """
import megatron.core.utils as mu
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint
keep = {'early': make_sharded_tensor_for_checkpoint, 'early_tp': make_tp_sharded_tensor_for_checkpoint}
import megatron.core.transformer.utils as tu
import megatron.core.tensor_parallel.layers as tl
import mcore_ckpt_fixes
from mcore_ckpt_fixes.fixes.dtensor_placement.runtime import core as dp
assert {r['id']: r['state'] for r in mcore_ckpt_fixes.report()}['dtensor-placement'] == 'applied'
for mod in (mu, tu):
    assert mod.make_sharded_tensor_for_checkpoint is dp.make_sharded_tensor_for_checkpoint, mod
    assert mod.make_tp_sharded_tensor_for_checkpoint is dp.make_tp_sharded_tensor_for_checkpoint, mod
assert tl.make_tp_sharded_tensor_for_checkpoint is dp.make_tp_sharded_tensor_for_checkpoint
assert make_sharded_tensor_for_checkpoint is dp.make_sharded_tensor_for_checkpoint, 'this script bound it too'
mcore_ckpt_fixes.revert()
assert tu.make_sharded_tensor_for_checkpoint is keep['early'] and mu.make_tp_sharded_tensor_for_checkpoint is keep['early_tp']
"""
    )


@pytest.mark.one_line  # the engine's rebinding, reload, pickle and revert, which tests/engine/test_lifecycle.py checks for every fix on every line
def test_binding_made_while_applied_behaves_as_reverted_after_revert():
    """Fix first, Megatron after: modules bind the replacement itself, and the engine's revert does
    not know those bindings. They forward to what megatron.core.utils holds now."""
    check_py(
        """
import mcore_ckpt_fixes
import megatron.core.utils as mu
import megatron.core.transformer.utils as tu
from mcore_ckpt_fixes.fixes.dtensor_placement.runtime import core as dp
from mcore_ckpt_fixes.engine.probing import Group
assert tu.make_sharded_tensor_for_checkpoint is dp.make_sharded_tensor_for_checkpoint
g = dict(tp_group=Group(rank=0, size=1), dp_cp_group=Group(rank=3, size=4))
assert tu.make_sharded_tensor_for_checkpoint(dp.probe_dtensor(), 'k', **g).global_shape == (4, 3)
mcore_ckpt_fixes.revert()
assert mu.make_sharded_tensor_for_checkpoint is not dp.make_sharded_tensor_for_checkpoint
assert tu.make_sharded_tensor_for_checkpoint(dp.probe_dtensor(), 'k', **g).global_shape == (2, 3)  # the release's
"""
    )
