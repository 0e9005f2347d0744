"""ep-change-optimizer-chain: both halves on every affected CI line (see checks/core.py): fix off,
the EP=2 checkpoint's load under EP=1 stops on every rank with the release's KeyError; fix on, EP 2 -> 1
and back to 2 load every tensor as full tensors bit for bit, with the scheduler and the iteration,
and train on. Where the release has no such load (a chain of one saved and loaded: every other
layout) nothing changes: the resume check's configurations and layout changes cover that
(tests/resume)."""

import pytest
from conftest import needs_megatron_training
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain import FIX
from mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.ep_change_optimizer_chain.checks.core"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    needs_megatron_training()
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_ep_change_stops_the_load_on_every_rank(worlds, mcore_version):
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False]), [
        (r["phase"], r["error"]) for r in worlds[False]
    ]
    assert all(r["phase"] == "load" and r["error"] == sc.EP2_TO_EP1 for r in worlds[False])


def test_patched_ep_change_both_ways_is_exact_on_every_rank(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["iteration/moe-ep1-dp2"] == r["iteration/moe-ep2"] == 2, r
        # Two optimizers saved, one loaded and saved; then one saved, two loaded and saved.
        assert r["chain/moe-ep1-dp2"] == (2, 1) and r["chain/moe-ep2"] == (1, 2), r
        names = r["max_delta"]
        assert any(k.startswith("moe-ep1-dp2/") for k in names) and any(k.startswith("moe-ep2/") for k in names)
        assert any("exp_avg_sq" in k for k in names) and any("experts" in k for k in names), sorted(names)[:20]
        assert not {k: d for k, d in names.items() if d != 0.0}, rank
