"""fsdp2-swiglu-split: both halves on the affected release lines (0.16.1, 0.17.1, 0.18.2), one warm
world each (2 gloo ranks): a SwiGLU MLP under Megatron's own TorchFullyShardedDataParallel (DP=2)
saved with dist_checkpointing, loaded in its own layout and unsharded
(mcore_ckpt_fixes/fixes/fsdp2_swiglu_split/checks/core.py). Plus, without a world, every rank's
pieces of TP x DP layouts assembled into the global [W; V] (exact, no gap, no overlap) and the call
shapes the fix leaves to the release. The probe (0.19.2: not needed): tests/fixes/test_every_fix.py.
"""

import pytest
import torch

from fix_worlds import both_halves
from mcore_ckpt_fixes.fixes.fsdp2_swiglu_split import FIX
from mcore_ckpt_fixes.fixes.fsdp2_swiglu_split.checks import scenarios as sc
from mcore_ckpt_fixes.testing import for_fix

CORE = "mcore_ckpt_fixes.fixes.fsdp2_swiglu_split.checks.core"
MODULE = "megatron.core.transformer.mlp"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:cases", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_own_layout_exact_unsharded_w_and_v_rows_swapped(worlds, mcore_version):
    """Resuming in the same layout hides it; any other reader gets W's second half and V's first
    half swapped, in the weight, the bias and both moments."""
    results = [w["fsdp2_mlp"] for w in worlds[False]]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.SCRAMBLED.phase, sc.SCRAMBLED.error), (rank, r.get("traceback"))
        own = {k: d for k, d in r["max_delta"].items() if not k.startswith("unsharded/")}
        assert len(own) == 12 and set(own.values()) == {0.0}, (rank, own)
        assert r["max_delta"]["unsharded/linear_fc2.weight"] == 0.0, rank  # only the SwiGLU factory
        assert r["warnings"] == [], rank
    assert for_fix(FIX.id)[0].bug_for(mcore_version).seen_in(results)


def test_patched_exact_in_place_and_unsharded_on_every_rank(worlds):
    for rank, r in enumerate(w["fsdp2_mlp"] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert r["n_tensors"] == 24 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["warnings"] == [], rank  # its own marks: read in place, silently


def test_patched_reads_a_checkpoint_the_release_wrote_as_written_with_a_warning(worlds):
    """A checkpoint written without the fix (W and V rows split per shard, no marks) still resumes
    exactly in the layout that wrote it, and each rank says which tensors it read that way."""
    keys = sorted(
        f"{p}linear_fc1.{n}"
        for p in ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq.")
        for n in ("bias", "weight")
    )
    for rank, r in enumerate(w["old_checkpoint"] for w in worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] == 12 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        (warning,) = r["warnings"]
        assert warning.startswith(f"the SwiGLU linear_fc1 tensors {keys} of this FSDP2 checkpoint"), warning


# -- every rank's pieces, without a world ----------------------------------------------------------


def _mesh(rank, size):
    """A CPU DeviceMesh of ``size`` ranks on which this process is ``rank``, without process groups."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(size), _init_backend=False, _rank=rank)


def _release_factory(mlp, sh, sharded_offsets=()):
    """The release's ``apply_swiglu_sharded_factory`` (0.12-0.15 take no singleton argument)."""
    import inspect

    from mcore_ckpt_fixes.engine.patching import original

    fn = original(mlp, "apply_swiglu_sharded_factory")
    if "singleton_local_shards" in inspect.signature(fn).parameters:
        return fn(sh, sharded_offsets, False)
    return fn(sh, sharded_offsets)


def _rank_factory(mlp, full_local, tp_rank, tp, dp_rank, dp, expert):
    """What MLP.sharded_state_dict gives this (tp, dp) rank under FSDP2, fixed: the DTensor shard
    of its TP-local [W; V], described as the release's helper describes it (``expert``: the
    expert axis SequentialMLP prepends, expert 1 of 2)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.tensor import DTensor, Shard

    from mcore_ckpt_fixes.fixes.fsdp2_swiglu_split.runtime import core

    core.bind_mapping_globals()
    rows = full_local.shape[0] // dp
    local = full_local[dp_rank * rows : (dp_rank + 1) * rows]
    param = DTensor.from_local(local, _mesh(dp_rank, dp), [Shard(0)], run_check=False)
    prepend = ((0, 1, 2),) if expert else ()
    sh = ShardedTensor.from_rank_offsets(
        "fc1",
        local,
        *prepend,
        (len(prepend), tp_rank * dp + dp_rank, tp * dp),
        replica_id=(0, 0, 0),
        prepend_axis_num=len(prepend),
    )
    return core._swiglu_factory_for_dtensor_shard(_release_factory(mlp, sh, prepend), param), local


@pytest.mark.parametrize("expert", [False, True], ids=["dense", "expert-axis"])
@pytest.mark.parametrize("bias", [False, True], ids=["weight", "bias"])
@pytest.mark.parametrize("tp,dp", [(1, 2), (1, 3), (1, 4), (1, 6), (2, 2), (2, 3), (4, 2)])
def test_every_rank_writes_its_rows_where_they_belong(mcore_version, tp, dp, bias, expert):
    """TP x DP ranks, each holding 1/dp of its TP-local [W_tp; V_tp] (24 rows): the pieces of all
    ranks tile the global [W; V] exactly once, with one global shape and grid, and hold its rows;
    the release's merge of this rank's pieces gives its shard back."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import megatron.core.transformer.mlp as mlp

    half = 12
    shape = (tp * 2 * half,) if bias else (tp * 2 * half, 3)
    w, v = torch.randn(shape).split(tp * half)  # the global W and V
    expected = torch.cat([w, v])
    assembled, covered, grids = torch.full(shape, float("nan")), torch.zeros(shape[0], dtype=torch.int), set()
    for tp_rank in range(tp):
        full_local = torch.cat([w[tp_rank * half : (tp_rank + 1) * half], v[tp_rank * half : (tp_rank + 1) * half]])
        for dp_rank in range(dp):
            factory, local = _rank_factory(mlp, full_local, tp_rank, tp, dp_rank, dp, expert)
            pieces = factory.build_fn(factory.key, factory.data, factory.replica_id, None)
            for sh in pieces:
                grids.add((tuple(sh.global_shape), sh.axis_fragmentations, sh.key, sh.prepend_axis_num))
                if expert:  # expert 1 of 2, kept in front
                    assert (sh.prepend_axis_num, sh.global_offset[0], sh.global_shape[0]) == (1, 1, 2), sh
                at = sh.global_offset[sh.prepend_axis_num]
                assembled[at : at + sh.local_shape[0]] = sh.data
                covered[at : at + sh.local_shape[0]] += 1
            assert torch.equal(factory.merge_fn([sh.data for sh in pieces]), local), (tp_rank, dp_rank)
    assert len(grids) == 1, grids
    assert covered.tolist() == [1] * shape[0]
    assert torch.equal(assembled, expected)


def test_the_release_keeps_what_the_fix_does_not_recognise(mcore_version):
    """A plain tensor, a Replicate DTensor, a flattened range, singleton keys and uneven shards
    (whose release description is not at the DTensor's rows) get the release's factory itself."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import dataclasses
    import inspect

    import megatron.core.transformer.mlp as mlp
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from mcore_ckpt_fixes.engine.patching import original
    from mcore_ckpt_fixes.fixes.fsdp2_swiglu_split.runtime import core

    core.bind_mapping_globals()
    fix = core._swiglu_factory_for_dtensor_shard
    local = torch.randn(12, 3)
    sh = ShardedTensor.from_rank_offsets("fc1", local, (0, 1, 2), replica_id=(0, 0, 0))
    factory = _release_factory(mlp, sh)
    sharded = DTensor.from_local(local, _mesh(1, 2), [Shard(0)], run_check=False)
    assert fix(factory, local) is factory
    assert fix(factory, DTensor.from_local(local, _mesh(1, 2), [Replicate()], run_check=False)) is factory
    assert fix(dataclasses.replace(factory, flattened_range=slice(0, 6)), sharded).flattened_range == slice(0, 6)
    assert fix(factory, sharded) is not factory  # the layout it recognises
    if "singleton_local_shards" in inspect.signature(original(mlp, "apply_swiglu_sharded_factory")).parameters:
        singleton = original(mlp, "apply_swiglu_sharded_factory")(sh, (), True)
        assert fix(singleton, sharded) is singleton
    # 26 rows over 4 ranks: torch's shards are 7, 7, 7, 5 rows; the release describes the last one
    # as shard 3 of 4 of 5 rows (rows 15-19), not rows 21-25.
    last = torch.randn(5, 3)
    uneven = _release_factory(mlp, ShardedTensor.from_rank_offsets("fc1", last, (0, 3, 4), replica_id=(0, 0, 0)))
    param = DTensor.from_local(last, _mesh(3, 4), [Shard(0)], run_check=False, shape=(26, 3), stride=(3, 1))
    assert fix(uneven, param) is uneven
