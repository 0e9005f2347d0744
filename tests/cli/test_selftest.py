"""``python -m mcore_ckpt_fixes selftest`` on this environment's release, as a user runs it.

One run of three fixes (``--json --fix``: every scenario of a fix the release needs whose bug raises,
of one whose bug is another rank's values, and of one the release does not need (on 0.18.2), fix off
and on; the whole matrix runs it on one line, ``one_line``): a full run is these runs for every fix,
and every fix's scenarios run on every line in the fix tests, which hold each world to selftest's
judgement (``Bug.seen_in``). Two runs that skip every scenario (no world is started, so they cost
only the Megatron import), bad usage, and the judgement the selftest applies to a world's results. The CUDA path is marked ``gpu`` (deselected by default).
"""

import json
import os

import pytest

from conftest import ROOT, run_cli
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.fixes import ORDER
from mcore_ckpt_fixes.testing import Bug, for_fix


def _json_run(args):
    proc = run_cli(["selftest", "--json", *args], timeout=900)
    try:
        rows = {r["id"]: r for r in json.loads(proc.stdout)}  # stdout is the JSON and nothing else
    except ValueError:
        pytest.fail(f"stdout is not JSON (exit {proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc, rows


def _check_unimplemented(rows, mcore_version, asked=ORDER):
    fixes = ENGINE.discover()
    assert list(rows) == [fix_id for fix_id in ORDER if fix_id in asked]
    for fix_id, row in rows.items():
        if not fixes[fix_id].implemented:  # listed as such, never "passed"
            assert row["verdict"] == "unimplemented" and row["scenarios"] == [], row
            assert row["needed"] is None and row["in_affected_range"] == (mcore_version in fixes[fix_id].specifiers)


# Named out of the registry's order: --fix reports in the registry's order whatever order it is given.
ASKED = ("chained-optim-main-params-split", "expert-keys", "tp-group")


@pytest.mark.one_line  # its round trips are the fix tests' scenarios, which every line runs
def test_selftest_json_on_this_release(mcore_version):
    proc, rows = _json_run(["--fix", ",".join(ASKED)])
    _check_unimplemented(rows, mcore_version, ASKED)
    fixes = ENGINE.discover()
    runnable = [s for fix_id in ORDER if fix_id in ASKED and fixes[fix_id].implemented for s in for_fix(fix_id)]
    for i, s in enumerate(runnable, 1):  # a progress line per scenario, on stderr
        assert f"selftest [{i}/{len(runnable)}] {s.id}: " in proc.stderr, proc.stderr
    for fix_id in (f for f in ORDER if f in ASKED and fixes[f].implemented):
        _check_implemented(rows[fix_id], fix_id, mcore_version)
    assert proc.returncode == 0, proc.stderr


def _check_implemented(row, fix_id, mcore_version):
    """Every scenario of an implemented fix ran both halves; the verdict follows from them."""
    declared = {s.name: s for s in for_fix(fix_id)}
    assert [s["name"] for s in row["scenarios"]] == list(declared)
    assert row["megatron_core"] == str(mcore_version) and row["device"] == "cpu" and row["nproc"] is None
    state = row["state"]
    assert state in ("applied", "not-needed", "not-applicable"), row
    if state == "not-applicable":  # the feature is absent: its scenarios cannot build on this release
        assert row["verdict"] == "not-applicable", row
        for s in row["scenarios"]:
            assert s["skipped"].startswith("not applicable to this release: ") and s["exact"] is None, s
        return
    affected = state == "applied"
    assert affected == (mcore_version in ENGINE.discover()[fix_id].specifiers), row
    for s in row["scenarios"]:
        absent = declared[s["name"]].absent()
        # A feature this release lacks: GDN before 0.18 (the whole fix not needed), single grouped
        # expert tensors before 0.18 (expert-keys needed here, its other scenarios run).
        if absent:
            assert s["skipped"] == f"not applicable to this release: {absent}" and s["exact"] is None, s
            continue
        assert s["skipped"] is None, s
        assert s["exact"] is True, (s["name"], s["fix_on"])
        assert set(s["fix_on"]["max_delta_per_rank"]) == {0.0} and min(s["fix_on"]["n_tensors_per_rank"]) > 0, s
        assert all(set(st.values()) == {state} for st in s["fix_on"]["fix_state_per_rank"]), s
        bug = declared[s["name"]].bug_for(mcore_version) if affected else None
        if affected and bug is None:
            # The fix is needed here, but not for what this round trip exercises (mimo-optimizer on
            # 0.19: the load side only; tests/fixes/test_mimo_matrix.py covers that part).
            assert s["expected_with_fix_off"] == "round trip exact", s
            assert s["reproduced"] is False and s["fix_off"]["outcome"] == "exact", s["fix_off"]
        elif affected:
            assert s["reproduced"] is True and s["fix_off"]["outcome"] == "documented-bug", s["fix_off"]
            assert s["expected_with_fix_off"] == bug.describe()
            if bug.kind == "raises":
                assert [r["error"] for r in s["fix_off"]["ranks"]] == [bug.error] * s["nproc"]
                assert s["fix_off"]["observed"] == f"{bug.error} (in {bug.phase})"
        else:
            assert s["reproduced"] is False and s["fix_off"]["outcome"] == "exact", s["fix_off"]
    if affected:
        assert any(s["skipped"] is None for s in row["scenarios"]), row  # a pass rests on a round trip
        assert row["needed"] is True and row["verdict"] == "pass", row
    else:
        assert row["needed"] is False and row["verdict"] == "not-needed", row


def _measured_states(mcore_version):
    """Each fix's state on this release: as measured for every published release
    (tools/expected-status.json, which CI checks against `status` on all of them), else asked of
    `status` in its own interpreter (applying the fixes and importing their targets here would leave
    this pytest process patched, and on 0.16 import mamba_mixer before the tp-group tests install
    their mamba_ssm stand-in)."""
    with open(os.path.join(ROOT, "tools", "expected-status.json")) as f:
        measured = json.load(f).get(str(mcore_version))
    if measured is not None:
        return measured
    status = run_cli(["status", "--json"])
    assert status.returncode == 0, status.stderr
    return {r["id"]: r["state"] for r in json.loads(status.stdout)}


@pytest.mark.one_line  # selftest's own skip logic; which fixes a release needs: tests/engine/test_status.py
@pytest.mark.parametrize(
    "args, reason",
    [(["--nproc", "3"], "written for exactly 2 ranks; --nproc 3 asked"), (["--device", "cuda"], None)],
    ids=["nproc3", "cuda"],
)
def test_scenarios_that_cannot_run_are_skipped_never_passed(args, reason, mcore_version, tmp_path):
    if args[-1] == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("CUDA is available: the gpu-marked test covers --device cuda")
        reason = "CUDA is not available to this torch"
    # A user's flag is set aside (and said so): each fix is compared at its default and off.
    # TMPDIR: a selftest that does not pass keeps its log; keep it in this test's directory.
    proc = run_cli(["selftest", *args], {"MCORE_CKPT_FIX_TP_GROUP": "off", "TMPDIR": str(tmp_path)}, timeout=600)
    out = proc.stdout
    assert "ignoring MCORE_CKPT_FIX_TP_GROUP=off" in proc.stderr, proc.stderr
    affected = mcore_version in ENGINE.discover()["tp-group"].specifiers
    assert f"needed by this release: {'yes' if affected else 'no'}" in out, out
    for s in for_fix("tp-group"):
        assert f"skipped: {reason}" in next(ln for ln in out.splitlines() if ln.strip().startswith(s.name + " ")), out
    if affected:  # nothing verified: not a pass
        assert "NOT VERIFIED" in out and "PASS" not in out, out
    needed = [fix_id for fix_id, state in _measured_states(mcore_version).items() if state == "applied"]
    if needed:  # a needed fix whose scenarios were all skipped is not verified: exit 1
        assert proc.returncode == 1, out
        assert f"printed is in {tmp_path}" in proc.stderr, proc.stderr
    else:  # fixes this release does not need do not decide the exit status
        assert proc.returncode == 0, out


@pytest.mark.parametrize(
    "args",
    [["--device", "tpu"], ["--nproc", "0"], ["--fix", "tp-group,no-such-fix"], ["--fix", "tp-group", "--resume"]],
)
def test_bad_usage_exits_2_with_one_line(args):
    proc = run_cli(["selftest", *args], timeout=60)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and args[0] in lines[0] and "error" in lines[0], proc.stderr
    if "no-such-fix" in args[1]:  # names what was wrong and what is accepted
        assert "unknown fix id 'no-such-fix'; accepted: tp-group, " in lines[0], lines[0]
    assert proc.stdout == ""


def test_bug_judgement():
    raises = Bug.raises("sharded_state_dict", "AssertionError: x")
    hit = {"phase": "sharded_state_dict", "error": "AssertionError: x", "max_delta": {}}
    exact = {"phase": None, "error": None, "max_delta": {"w": 0.0}}
    assert raises.seen_in([hit, hit])
    assert not raises.seen_in([hit, exact]) and not raises.seen_in([hit, None]) and not raises.seen_in([])
    assert not raises.seen_in([dict(hit, error="AssertionError: x and more"), hit])  # exact text only
    wrong = Bug.wrong_values()
    # digests: per tensor, (what this rank saved, what it loaded), part by part.
    exact = dict(exact, digests={"w": (["r0"], ["r0"])})
    other_shard = {
        "phase": "compare",
        "error": "AssertionError: tensors differ after load",
        "max_delta": {"w": 0.5},
        "digests": {"w": (["r1"], ["r0"])},
    }
    assert wrong.seen_in([exact, other_shard])  # one rank reading another's shard is enough
    assert not wrong.seen_in([exact, exact]) and not wrong.seen_in([hit, other_shard])
    # Not the documented bug: a value no rank saved, another shape (inf), NaN, nothing to tell whose.
    unrelated = dict(other_shard, digests={"w": (["r1"], ["zeros"])})
    other_shape = dict(other_shard, max_delta={"w": float("inf")})
    nan = dict(other_shard, max_delta={"w": float("nan")})
    assert not any(wrong.seen_in([exact, r]) for r in (unrelated, other_shape, nan, dict(other_shard, digests={})))
    # A fused tensor whose components come from different ranks: each part is judged.
    parts = {"phase": "compare", "error": "x", "max_delta": {"w": 0.5}, "digests": {"w": (["a1", "b1"], ["a0", "b1"])}}
    fused = {"phase": "compare", "error": "x", "max_delta": {"w": 0.5}, "digests": {"w": (["a0", "b0"], ["a0", "b1"])}}
    assert wrong.seen_in([fused, parts])
    assert not wrong.seen_in([fused, dict(parts, digests={"w": (["a1", "b1"], ["a0", "c"])})])
    assert not wrong.seen_in([exact, dict(other_shard, max_delta={"w": 0.5, "v": 0.25})])  # "v": whose? unknown


def test_nan_is_never_the_largest_delta_dropped():
    """A NaN loaded after an exact tensor: Python's max() would report 0.0 for the rank."""
    from mcore_ckpt_fixes.cli.selftest_judge import is_exact, rank_rows
    from mcore_ckpt_fixes.testing.compare import worst
    from mcore_ckpt_fixes.testing.launcher import RankResult

    nan = float("nan")
    assert worst([0.0, nan]) != worst([0.0, nan]) and worst([nan, 0.0]) != worst([nan, 0.0])
    assert worst([0.0, 0.5, float("inf")]) == float("inf") and worst([]) == 0.0
    (row,) = rank_rows(
        [RankResult(0, True, {"error": None, "phase": None, "n_tensors": 2, "max_delta": {"a": 0.0, "b": nan}})]
    )
    assert row["max_delta"] != row["max_delta"] and not is_exact(row), row


@pytest.mark.gpu
def test_selftest_cuda(mcore_version):
    """``--device cuda`` on a machine with at least two GPUs (NCCL, spawned ranks).

    Not run on this project's CPU-only hosts: the CUDA path of the scenarios is untested there
    (tests/test_gpu_collection.py checks there that this test is collected and its fixtures resolve).
    """
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    proc, rows = _json_run(["--device", "cuda"])
    tp = rows["tp-group"]
    assert all(s["exact"] is True for s in tp["scenarios"]), tp
    # every rank really worked on its own GPU (the scenarios check each tensor's device too)
    devices = [r["device"] for s in tp["scenarios"] for r in s["fix_on"]["ranks"]]
    assert all(d and d.startswith("cuda") for d in devices), devices
    assert proc.returncode == 0, proc.stderr
