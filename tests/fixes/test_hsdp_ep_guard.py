"""hsdp-ep-guard: on 0.16, Megatron-FSDP with HSDP and EP > 1 is refused at set-up with one clear
line; every other configuration (and every release from 0.17) goes through untouched.

World: 4 gloo ranks, real ``parallel_state`` for EP=2, HSDP (2 optimizer instances) and both, the
real mesh construction of ``FullyShardedDataParallel`` (``_init_dist_index``) and a DCP round trip of
a dense and an expert parameter on the meshes each accepted configuration gets. Not run on a CPU
host: the rest of ``FullyShardedDataParallel.__init__`` (``MegatronFSDP`` allocates CUDA buffers);
the constructor test below stops at the guard, which comes before that.
"""

import types

import pytest

from mcore_ckpt_fixes.engine.probing import Group
from mcore_ckpt_fixes.fixes.hsdp_ep_guard import FIX
from mcore_ckpt_fixes.fixes.hsdp_ep_guard.runtime.core import refusal
from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.testing import for_fix

MODULE = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
SCENARIO = for_fix(FIX.id)[0]
ACCEPTED = {f"{c}/{t}": 0.0 for c in ("ep2", "hsdp") for t in ("dense", "expert")}
ALL = dict(ACCEPTED, **{f"hsdp_ep2/{t}": 0.0 for t in ("dense", "expert")})


def test_registry():
    """The documented error, pinned: the unpatched test compares the world with the registry's."""
    assert (SCENARIO.name, SCENARIO.bug.kind, SCENARIO.bug.phase) == ("configurations", "raises", "placement")
    assert SCENARIO.bug.error == (
        "AssertionError: hsdp_ep2: expert parameters are sharded on the dense data-parallel mesh, "
        "not over their expert-data-parallel ranks"
    )


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """Both halves, once each (4-rank worlds are the expensive part of this file)."""
    from mcore_ckpt_fixes.fixes.hsdp_ep_guard.checks.core import prepare

    prepare()
    out = {}
    for patched in (False, True):
        env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
        ckpt = str(tmp_path_factory.mktemp(f"patched{patched}"))
        out[patched] = values(
            run_world(SCENARIO.func, 4, {"ckpt_dir": ckpt, "patched": patched}, env=env, timeout=SCENARIO.timeout)
        )
    return out


def test_unpatched(worlds, mcore_version):
    results = worlds[False]
    for rank, r in enumerate(results):
        assert r["fix_state"] == {MODULE: "disabled"} and r["refused"] == {}, (rank, r)
        mesh = r["meshes"]["hsdp_ep2"]
        if mcore_version in FIX.specifiers:
            # 0.16: set-up "succeeds" and the experts of EP ranks 0 and 1 share one (dense) mesh.
            assert (r["phase"], r["error"]) == (SCENARIO.bug.phase, SCENARIO.bug.error), (rank, r.get("traceback"))
            assert mesh["expert"] == mesh["dense"] == [0, 1, 2, 3] and mesh["expert_dp_group"] != mesh["expert"]
            assert r["max_delta"] == ACCEPTED, (rank, r["max_delta"])
        else:  # 0.17+: an expert mesh of its own, and the round trip is exact
            assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
            assert mesh["expert"] == mesh["expert_dp_group"] and len(mesh["expert"]) == 2, mesh
            assert r["max_delta"] == ALL, (rank, r["max_delta"])
    assert SCENARIO.bug.seen_in(results) == (mcore_version in FIX.specifiers)


def test_patched(worlds, mcore_version):
    affected = mcore_version in FIX.specifiers
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied" if affected else "not-needed"}, (rank, r["fix_state"])
        if affected:  # refused, with exactly the guard's line; the other two untouched and exact
            assert r["refused"] == {"hsdp_ep2": refusal(2, 2)} and r["max_delta"] == ACCEPTED, (rank, r)
        else:
            assert r["refused"] == {} and r["max_delta"] == ALL, (rank, r)
        # Accepted configurations get the same meshes with the fix as without it.
        for name in ("ep2", "hsdp"):
            assert r["meshes"][name] == worlds[False][rank]["meshes"][name], (rank, name)


def test_refusal_is_one_clear_line():
    msg = refusal(2, 4)
    assert "\n" not in msg
    assert "num_distributed_optimizer_instances=2 (HSDP)" in msg and "expert_model_parallel_size=4" in msg
    assert (
        "Accepted: num_distributed_optimizer_instances=1 with expert parallelism, or expert_model_parallel_size=1"
        in msg
    )


def test_real_constructor_refuses_before_building_anything(mcore_version):
    """``FullyShardedDataParallel(...)`` itself, in this process: the guard is its first step, so it
    fires before any process group or CUDA buffer is touched (the groups here are inert)."""
    import torch

    import mcore_ckpt_fixes
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.transformer import TransformerConfig

    mcore_ckpt_fixes.apply()
    row = next(r for r in mcore_ckpt_fixes.report() if r["id"] == FIX.id)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True, num_moe_experts=4
    )
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        num_distributed_optimizer_instances=2,
    )
    pgs = types.SimpleNamespace(
        ep=Group(size=2),
        tp=Group(size=1),
        expt_tp=Group(size=1),
        intra_dp_cp=Group(size=2),
        inter_dist_opt=Group(size=2),
        dp_cp=Group(size=4),
        expt_dp=Group(size=2),
        intra_expt_dp=Group(size=1),
    )
    if mcore_version in FIX.specifiers:
        assert row["state"] == "applied", row
        with pytest.raises(ValueError) as info:
            FullyShardedDataParallel(config, ddp, torch.nn.Linear(8, 8), pg_collection=pgs)
        assert str(info.value) == refusal(2, 2)
    else:
        from mcore_ckpt_fixes.engine.patching import is_replacement

        assert row["state"] == "not-needed" and "outside the affected range" in row["reason"], row
        assert not is_replacement(FullyShardedDataParallel.__dict__["_init_dist_index"])


def test_probe(mcore_version):
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as m
    from mcore_ckpt_fixes.fixes.hsdp_ep_guard.runtime import core as patch

    verdict, why = patch.probe(m)  # the release's own method, even after apply
    if mcore_version in FIX.specifiers:
        assert (verdict, why) == (
            True,
            "HSDP with EP > 1 builds no expert mesh: experts are sharded on the dense data-parallel mesh",
        )
    else:
        assert (verdict, why) == (False, "HSDP with EP > 1 gets its own expert mesh")


def test_guard_passes_every_other_configuration_to_the_release(mcore_version, monkeypatch):
    """The patched ``_init_dist_index`` with explicit process groups (``pg_collection``, the path the
    4-rank scenario does not take): only HSDP x EP > 1 is refused; EP > 1 alone, HSDP alone and HSDP
    with a collection that has no EP group reach the release's own code, which builds its
    ``FSDPDistributedIndex`` (captured here: mesh helpers and ``DeviceMesh`` are inert stand-ins)."""
    import numpy as np

    import mcore_ckpt_fixes
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as m
    from mcore_ckpt_fixes.engine.patching import is_replacement

    mcore_ckpt_fixes.apply()
    method = m.FullyShardedDataParallel.__dict__["_init_dist_index"]
    if mcore_version not in FIX.specifiers:
        assert not is_replacement(method)
        return
    assert is_replacement(method)
    built = []
    monkeypatch.setattr(m, "FSDPDistributedIndex", lambda **kw: built.append(kw) or kw)
    monkeypatch.setattr(m, "DeviceMesh", types.SimpleNamespace(from_group=lambda *a, **k: "mesh"))
    monkeypatch.setattr(m, "_get_hsdp_tp_mesh", lambda *a, **k: np.zeros((2, 1, 1), dtype=int))
    monkeypatch.setattr(m, "_get_dp_tp_mesh", lambda *a, **k: np.zeros((1, 1), dtype=int))

    def run(instances, **groups):
        pgs = types.SimpleNamespace(
            tp=Group(size=1),
            expt_tp=Group(size=1),
            intra_dp_cp=Group(size=2),
            inter_dist_opt=Group(size=2),
            dp_cp=Group(size=4),
            expt_dp=Group(size=2),
            **groups,
        )
        wrapper = types.SimpleNamespace(
            ddp_config=types.SimpleNamespace(
                num_distributed_optimizer_instances=instances, outer_dp_sharding_strategy="no_shard"
            ),
            num_moe_experts=4,
        )
        before = len(built)
        m.FullyShardedDataParallel._init_dist_index(wrapper, pgs)
        assert len(built) == before + 1  # the release's own code ran to its FSDPDistributedIndex
        return built[-1]

    assert run(1, ep=Group(size=2))["expt_device_mesh"] == "mesh"  # EP alone: the release's expert mesh
    assert "hybrid_fsdp_group" in run(2, ep=Group(size=1))  # HSDP alone: the release's HSDP index
    assert "hybrid_fsdp_group" in run(2)  # HSDP, a collection without an EP group: EP = 1
    with pytest.raises(ValueError) as info:
        run(2, ep=Group(size=2))
    assert str(info.value) == refusal(2, 2) and len(built) == 3
