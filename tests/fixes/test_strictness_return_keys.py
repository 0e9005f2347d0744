"""strictness-return-keys: both halves on 0.17.1, 0.18.2 and 0.19.2, one warm world each; not
applicable on 0.16.1 (no megatron.training in the wheel).

World 2 (gloo on CPU): the resume check's dense GPT (DP=2, distributed optimizer), one step, saved by
megatron.training's save_checkpoint and loaded by load_checkpoint into a newly built job under
--dist-ckpt-strictness return_unexpected, return_all, and with --no-load-optim under return_all and
log_all. The fix-off half turns off this fix alone. See
mcore_ckpt_fixes/fixes/strictness_return_keys/checks/core.py.
"""

import ast
import json
import logging
import re

import pytest
from fix_worlds import both_halves

from conftest import check_py
from mcore_ckpt_fixes.fixes.strictness_return_keys import FIX, FUNCTION
from mcore_ckpt_fixes.fixes.strictness_return_keys.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.strictness_return_keys.checks.core import WAYS, way_name

CORE = "mcore_ckpt_fixes.fixes.strictness_return_keys.checks.core"
MODULE = "megatron.training.checkpointing"
RETURNING = [way_name(w) for w in WAYS if "--no-load-optim" not in w]  # return_unexpected, return_all
NO_OPTIM, LOG_ALL_NO_OPTIM = (way_name(w) for w in WAYS if "--no-load-optim" in w)
# What dist_checkpointing's log_all says of the keys no rank asked for (validation.py, 0.17-0.19).
RELEASE_MISSING = re.compile(r"Missing keys \(for all ranks\): (\{.*?\})\. ")
FIX_MISSING = re.compile(r"(\d+) missing \(in the checkpoint, asked for by no rank\): (\[.*?\])( and (\d+) more)?(;|$)")


def _has_training(mcore_version):
    return mcore_version.release >= (0, 17)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    return both_halves(FIX, f"{CORE}:round_trip", tmp_path_factory=tmp_path_factory, mcore_version=mcore_version)


def test_unpatched_every_rank_takes_the_tuple_for_the_state_dict(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        bug = sc.RETURNED_TUPLE
        assert (r["phase"], r["error"]) == (bug.phase, bug.error), (rank, r.get("traceback"))
        assert "load_checkpoint" in r["traceback"], r["traceback"][-2000:]
        # Every way that returns the keys stops on them; log_all, on the same request, loads.
        expected = {name: sc.RETURNED_TUPLE.error for name in [*RETURNING, NO_OPTIM]}
        assert r["outcomes"] == {**expected, LOG_ALL_NO_OPTIM: "ok"}, (rank, r["outcomes"])
        assert set(r["max_delta"].values()) == {0.0}, r["max_delta"]
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_return_values_load_exactly(worlds):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert set(r["outcomes"].values()) == {"ok"} and len(r["outcomes"]) == len(WAYS), r["outcomes"]
        assert set(r["iteration"].values()) == {1}, r["iteration"]
        assert r["max_delta"] and set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        for name in RETURNING:
            compared = [k for k in r["max_delta"] if k.startswith(f"{name}/")]
            # The model, the distributed optimizer's main values and moments, the scheduler, the RNG.
            assert any(k.startswith(f"{name}/param:") for k in compared), compared
            assert any(k.endswith(":exp_avg_sq") for k in compared), compared
            assert any(k.startswith(f"{name}/scheduler:") for k in compared), compared
            assert any(k.startswith(f"{name}/rng:tracker:") for k in compared), compared
            # The keys match: nothing to say, from the fix or the release.
            assert r["logged"][name] == {"fix": [], "release": []}, (name, r["logged"][name])
        assert r["logged"][LOG_ALL_NO_OPTIM]["fix"] == [], r["logged"][LOG_ALL_NO_OPTIM]


def test_patched_returned_keys_are_logged_as_log_all_reports_them(worlds):
    """Under --no-load-optim no rank asks for the checkpoint's optimizer state: with the fix each
    rank logs one line naming those keys, the keys log_all reports on the same load (whose model
    loads the same), and dist_checkpointing itself says nothing under return_all."""
    for rank, r in enumerate(worlds[True]):
        ours, release = r["logged"][NO_OPTIM], r["logged"][LOG_ALL_NO_OPTIM]
        assert ours["release"] == [] and len(ours["fix"]) == 1, (rank, ours)
        (line,) = ours["fix"]
        assert line.startswith(f"rank {rank}: the load's request and the checkpoint do not match"), line
        assert "unexpected (asked for" not in line, line
        (reported,) = [set(ast.literal_eval(m.group(1))) for m in map(RELEASE_MISSING.search, release["release"]) if m]
        assert reported and all(k.startswith("optimizer.") for k in reported), reported
        count, shown, _, more, _ = FIX_MISSING.search(line).groups()
        assert int(count) == len(reported), (line, reported)
        assert ast.literal_eval(shown) == sorted(reported)[:8], (line, sorted(reported))
        assert int(more or 0) == max(len(reported) - 8, 0), line
        # The same model loaded as under log_all: the same tensors compared, the same bits.
        ours, theirs = _loaded(r, NO_OPTIM), _loaded(r, LOG_ALL_NO_OPTIM)
        assert ours and ours == theirs and all(k.startswith("param:") for k in ours), (ours.keys(), theirs.keys())


def _loaded(r, way):
    """{tensor: the digests of what the way loaded} for one way of loading."""
    return {k.partition("/")[2]: loaded for k, (_, loaded) in r["digests"].items() if k.startswith(f"{way}/")}


# -- the warning itself, on stand-in results (no world, no Megatron) --------------------------------


@pytest.mark.one_line  # the helper's text, the same on every line
def test_state_dict_alone_logs_the_keys_once_and_truncates(caplog):
    from mcore_ckpt_fixes.fixes.strictness_return_keys.runtime import core

    state = {"model": 1}
    missing = {f"optimizer.k{i:02d}" for i in range(11)}
    with caplog.at_level(logging.WARNING, logger="mcore_ckpt_fixes"):
        assert core._state_dict_alone((state, missing, {"model.extra"})) is state
    (record,) = caplog.records
    text = record.getMessage()
    assert record.levelno == logging.WARNING and text.startswith("rank 0: the load's request"), text
    shown = [f"optimizer.k{i:02d}" for i in range(8)]
    assert f"11 missing (in the checkpoint, asked for by no rank): {shown!r} and 3 more; " in text, text
    assert text.endswith("1 unexpected (asked for by this rank, not in the checkpoint, not loaded): ['model.extra']")


@pytest.mark.one_line  # the helper's text, the same on every line
def test_state_dict_alone_leaves_what_the_release_handles(caplog):
    """The state dict alone (every other strictness, the common state): the same object, no word;
    the triple with no mismatch: its state dict, no word."""
    from mcore_ckpt_fixes.fixes.strictness_return_keys.runtime import core

    state = {"model": 1}
    with caplog.at_level(logging.DEBUG, logger="mcore_ckpt_fixes"):
        assert core._state_dict_alone(state) is state
        assert core._state_dict_alone((state, set(), set())) is state
        odd = (state, "x")  # not dist_checkpointing.load's triple: passed on as it is
        assert core._state_dict_alone(odd) is odd
    assert caplog.records == []


# -- status, probe, layer order ------------------------------------------------------------------------


def test_not_applicable_before_017(mcore_version):
    """0.16 has no megatron.training in the wheel: the fix says not-applicable, nothing is patched."""
    if _has_training(mcore_version):
        pytest.skip("megatron.training is in this wheel (see test_status_probe_and_layer_order)")
    out = check_py(
        """
        import json, mcore_ckpt_fixes
        from mcore_ckpt_fixes.cli.status import import_targets
        import_targets()
        row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["strictness-return-keys"]
        print(json.dumps(row))
        """
    )
    row = json.loads(out.strip().splitlines()[-1])
    assert mcore_version not in FIX.specifiers
    assert row["state"] == "not-applicable" and f"cannot import {MODULE}" in row["reason"], row


def test_status_probe_and_layer_order(mcore_version):
    """Applied, with the probe's reason; the layer is the module's function below rng-under-ep's
    (which reads the state dict it hands on); the probe judges the release's code, also after
    apply, and leaves the live module's globals as they were."""
    if not _has_training(mcore_version):
        pytest.skip("megatron.training ships in the wheel from 0.17")
    out = check_py(
        """
        import json
        import megatron.training.checkpointing as m
        import mcore_ckpt_fixes
        from mcore_ckpt_fixes.engine.patching import below, original
        from mcore_ckpt_fixes.fixes.rng_under_ep.runtime import core as rng
        from mcore_ckpt_fixes.fixes.strictness_return_keys.runtime import core as f
        row = {r["id"]: r for r in mcore_ckpt_fixes.report()}["strictness-return-keys"]
        out = {"state": row["state"], "reason": row["reason"]}
        name = "_load_global_dist_base_checkpoint"
        out["top"] = getattr(m, name) is rng.load_global_dist_base_checkpoint
        out["under_rng"] = below("rng-under-ep", m, name) is f.load_global_dist_base_checkpoint
        out["under_ours"] = below("strictness-return-keys", m, name) is original(m, name)
        # The release's parameters as its callers and the layer above bind them (0.19's groups: **groups).
        import inspect
        ours = inspect.signature(f.load_global_dist_base_checkpoint).parameters
        out["unnamed"] = [p for p in inspect.signature(original(m, name)).parameters if p not in ours]
        before = dict(vars(m))
        out["probe_after"] = f.probe(m)[0]
        out["changed"] = sorted(k for k in set(before) | set(vars(m)) if vars(m).get(k) is not before.get(k))
        print(json.dumps(out))
        """
    )
    out = json.loads(out.strip().splitlines()[-1])
    assert out["state"] == "applied" and f"{FUNCTION} hands on dist_checkpointing.load's" in out["reason"], out
    assert out["top"] and out["under_rng"] and out["under_ours"], out
    assert set(out["unnamed"]) <= {"dp_cp_group", "expt_dp_group"}, out["unnamed"]
    assert out["probe_after"] is True and out["changed"] == [], out
