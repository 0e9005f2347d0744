"""tp-group: both halves on every release line, real Megatron-Core modules, real dist_checkpointing.

World 2, TP=2, gloo on CPU, models built from an explicit ProcessGroupCollection (parallel_state
never initialised). Stand-in used: ``mamba_ssm`` (CUDA/Triton kernels that cannot be installed on
a CPU host), see mcore_ckpt_fixes/testing/_standins.py for exactly what it replaces and why.
"""

import pytest

from conftest import check_py
from mcore_ckpt_fixes.fixes.tp_group import FIX
from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.testing import for_fix, resolve

# The registry selftest runs too: each scenario with the exact error it shows without the fix
# (see mcore_ckpt_fixes/scenarios/__init__.py for why a lone MambaMixer's differs).
SCENARIOS = {s.name: s for s in for_fix("tp-group")}
BATCH = "mcore_ckpt_fixes.fixes.tp_group.checks.core:cases"


def test_registry_declares_every_round_trip():
    """Pinned here as well: a registry edit must not quietly move what "the bug reproduced" means."""
    assert {n: (s.bug.kind, s.bug.phase, s.bug.error) for n, s in SCENARIOS.items()} == {
        "mamba_stack": (
            "raises",
            "sharded_state_dict",
            "AssertionError: tensor model parallel group is not initialized",
        ),
        "mamba_mixer": (
            "raises",
            "sharded_state_dict",
            "AssertionError: data parallel group with context parallel combined is not initialized",
        ),
        "radio_vit": ("raises", "sharded_state_dict", "AssertionError: tensor model parallel group is not initialized"),
    }


@pytest.fixture(scope="module", autouse=True)
def warm_parent():
    """Import everything once here (the scenarios' prepare hooks): every world below is forked from this process."""
    for hook in dict.fromkeys(s.prepare for s in SCENARIOS.values()):
        resolve(hook)()


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """``{patched: {name: [each rank's result]}}``: the three scenarios in one world per half, as
    the GPU check runs them (their ``batch``)."""
    out = {}
    for patched in (False, True):
        env = {} if patched else {"MCORE_CKPT_FIXES": "off"}
        ckpt = str(tmp_path_factory.mktemp(f"patched{patched}"))
        ranks = values(
            run_world(
                BATCH,
                2,
                {"ckpt_dir": ckpt, "patched": patched, "names": list(SCENARIOS)},
                env=env,
                timeout=sum(s.timeout for s in SCENARIOS.values()),
            )
        )
        out[patched] = {name: [r[name] for r in ranks] for name in SCENARIOS}
    return out


def test_batch_is_declared():
    assert {s.batch for s in SCENARIOS.values()} == {BATCH}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_unpatched(name, halves, mcore_version):
    results = halves[False][name]
    bug = SCENARIOS[name].bug
    if mcore_version in FIX.specifiers:
        for rank, r in enumerate(results):
            assert r["phase"] == bug.phase, (rank, r)
            assert r["error"] == bug.error, (rank, r["error"])
        assert bug.seen_in(results)  # selftest's judgement agrees
    else:  # fixed upstream: the fix is off and the round trip is exact anyway
        for rank, r in enumerate(results):
            assert r["error"] is None, (rank, r.get("traceback"))
            assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r)
        assert not bug.seen_in(results)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_patched_round_trip_is_exact(name, halves, mcore_version):
    results = halves[True][name]
    expected_state = "applied" if mcore_version in FIX.specifiers else "not-needed"
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert set(r["fix_state"].values()) == {expected_state}, (rank, r["fix_state"])


def test_classic_parallel_state_models_identical(tmp_path):
    results = values(
        run_world(
            "mcore_ckpt_fixes.fixes.tp_group.checks.classic_models:classic_models_identical",
            2,
            {"ckpt_dir": str(tmp_path)},
            timeout=240,
        )
    )
    for rank, per_model in enumerate(results):
        for name, r in per_model.items():
            assert r["descriptions_equal"] and r["values_equal"], (rank, name, r)
            assert r["n_sharded"] > 0 and r["round_trip_max_delta"] == 0.0, (rank, name, r)


# -- import order and spawn, specific to this fix's constructors (the generic lifecycle is tests/engine/test_lifecycle.py)


def test_tp_group_takes_hold_in_either_order(mcore_version):
    """On releases with the bug, the real fix lands whether Megatron comes first or second."""
    expect = "applied" if mcore_version in FIX.specifiers else "not-needed"
    for order in ("fixes-first", "megatron-first"):
        code = """
import sys
if ORDER == 'megatron-first':
    import megatron.core.ssm.mamba_layer
import mcore_ckpt_fixes
import megatron.core.ssm.mamba_layer as ml
from mcore_ckpt_fixes.fixes.tp_group.runtime import core as patch
state = {r['id']: r for r in mcore_ckpt_fixes.report()}['tp-group']
patched = ml.MambaLayer.__dict__['__init__'] is patch.mamba_layer_init
print(state['targets']['megatron.core.ssm.mamba_layer']['state'], patched)
""".replace("ORDER", repr(order))
        out = check_py(code).split()
        assert out == [expect, str(expect == "applied")], (order, out)


def test_tp_group_fixed_constructor_in_spawn_child(mcore_version):
    out = check_py(
        """
import multiprocessing as mp, types
import mcore_ckpt_fixes
from megatron.core.ssm.mamba_layer import MambaLayer

def child(cls):
    import types
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    pg = types.SimpleNamespace(tp='the-tp-group')
    layer = cls(cfg, MambaLayerSubmodules(norm=IdentityOp, mixer=IdentityOp, mamba_bda=IdentityOp), pg_collection=pg)
    return getattr(layer, 'tp_group', None)

if __name__ == '__main__':
    with mp.get_context('spawn').Pool(1) as pool:
        print(pool.apply(child, (MambaLayer,)))
"""
    )
    # Fixed (or never buggy): the child's MambaLayer keeps the group it was given.
    assert out.strip() == "the-tp-group", out
