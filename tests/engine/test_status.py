"""``status`` in this environment: every fix id, an honest state, the Megatron-Core version and source."""

import json

import pytest

from conftest import run_cli
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.fixes import ORDER


def _status(env=None):
    proc = run_cli(["status", "--json"], env)
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)}


def test_every_fix_listed_with_honest_state(mcore_version):
    rows = _status()
    assert list(rows) == list(ORDER)
    fixes = ENGINE.discover()
    for fix_id, row in rows.items():
        assert {"id", "state", "reason", "megatron_core", "megatron_source"} <= set(row)
        assert row["megatron_core"] == str(mcore_version) and row["megatron_source"] == "wheel"
        if not fixes[fix_id].implemented:
            assert row["state"] == "unimplemented", row  # never "applied"
            assert "not implemented" in row["reason"]
    tp = rows["tp-group"]
    if mcore_version in fixes["tp-group"].specifiers:
        assert tp["state"] == "applied", tp
        assert set(tp["targets"]) == {t.module for t in fixes["tp-group"].targets}
        assert {t["state"] for t in tp["targets"].values()} == {"applied"}
    else:
        assert tp["state"] == "not-needed", tp
        assert "outside the affected range" in tp["reason"]


def test_forced_on_outside_range_defers_to_probe(mcore_version):
    rows = _status({"MCORE_CKPT_FIX_TP_GROUP": "on"})
    tp = rows["tp-group"]
    if mcore_version in ENGINE.discover()["tp-group"].specifiers:
        assert tp["state"] == "applied"
    else:  # 0.19+: the probes see the upstream fix and nothing is patched
        assert tp["state"] == "not-needed" and "probe:" in tp["reason"], tp


@pytest.mark.one_line
def test_disabled_flag_and_text_output():
    rows = _status({"MCORE_CKPT_FIX_TP_GROUP": "off"})
    assert rows["tp-group"]["state"] == "disabled"
    assert "MCORE_CKPT_FIX_TP_GROUP" in rows["tp-group"]["reason"]
    proc = run_cli(["status", "--no-import"])
    assert proc.returncode == 0
    head, *lines, known = proc.stdout.strip().splitlines()
    assert head.startswith("mcore-ckpt-fixes ") and "Megatron-Core" in head and "(wheel:" in head
    assert known.startswith("known bugs: ") and known.endswith("(docs/known-bugs.md)"), (
        known
    )  # tests/test_known_bugs.py
    # One line per fix; under a fix that reaches frameworks, one indented line per target.
    fix_lines = [ln for ln in lines if not ln.startswith("    ")]
    assert [ln.split()[0] for ln in fix_lines] == list(ORDER)
    assert fix_lines[0].split()[1] == "pending"  # nothing imported Megatron yet
    targets = [ln.strip() for ln in lines if ln.startswith("    ")]
    assert "verl.utils.checkpoint.megatron_checkpoint_manager (verl): not-applicable" in targets, targets


def test_checkout_on_pythonpath_is_reported_as_checkout(tmp_path, mcore_version):
    """A Megatron-LM checkout (no dist-info) shadowing the wheel is named as such."""
    import shutil

    import megatron

    src = next(iter(megatron.__path__))
    shutil.copytree(src, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    proc = run_cli(["status", "--json", "--no-import"], {"PYTHONPATH": f"{tmp_path}"})
    # run_cli appends the inherited PYTHONPATH after ours: the checkout comes first and wins
    rows = json.loads(proc.stdout)
    assert rows[0]["megatron_source"] == "checkout", rows[0]
    assert rows[0]["megatron_path"] == str(tmp_path / "megatron")


@pytest.mark.one_line
def test_text_output_never_cuts_a_name():
    """A reason's dotted names stay whole in the text output's column, even when longer than it."""
    from mcore_ckpt_fixes.cli.status import WIDTH, wrap_reason

    name = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.load_state_dict"
    reason = f"the probe found {name} restoring a stale step for every parameter of the group"
    indent = 2 + len("chained-optim-main-params-split") + 2 + 14 + 2
    assert WIDTH - indent < len(name)  # the column is narrower than the name
    lines = wrap_reason(reason, indent)
    assert name in lines
    assert " ".join(lines) == reason
