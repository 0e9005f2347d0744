"""The known-bugs catalogue (mcore_ckpt_fixes/known_bugs.json): well formed, consistent with the fixes,
counted right for a release, printed by ``status``, and a malformed file named in one line."""

import json
import os
import shutil

import pytest
from packaging.specifiers import SpecifierSet

from conftest import ROOT, run_cli, run_py
from mcore_ckpt_fixes import known_bugs
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.fixes import ORDER


def _raw():
    with open(known_bugs.PATH, encoding="utf-8") as f:
        return json.load(f)


def _sweep_releases():
    with open(os.path.join(ROOT, "tools", "sweep-releases.txt")) as f:
        return [ln.split()[0] for ln in f if ln.strip() and not ln.startswith("#")]


def test_catalogue_is_well_formed():
    bugs = known_bugs.load()
    assert bugs == _raw()["bugs"] and len(bugs) >= 30
    ids = [b["id"] for b in bugs]
    assert len(ids) == len(set(ids))
    fixes = ENGINE.discover()
    for b in bugs:
        assert set(b) >= {"id", "symptom", "affected", "upstream", "status", "silent"}, b["id"]
        assert b["status"] in known_bugs.STATUSES and isinstance(b["silent"], bool), b["id"]
        assert b["upstream"] and all(isinstance(r, str) and r for r in b["upstream"]), b["id"]
        assert any(SpecifierSet(b["affected"]).contains(r) for r in _sweep_releases()), b["id"]  # parses, not empty
        detail = known_bugs.DETAIL[b["status"]]
        assert b[detail].strip(), b["id"]
        if detail == "fix":
            assert b["fix"] in fixes, b["id"]


def test_every_fix_is_catalogued_and_covers_what_its_entries_affect():
    bugs = known_bugs.load()
    covered = {b["fix"] for b in bugs if b["status"] in ("fixed", "guarded")}
    assert covered == set(ORDER)
    fixes = ENGINE.discover()
    for b in bugs:
        if "fix" not in b:
            continue
        # A release the entry affects is one its fix is declared for: "fixed" is never claimed
        # for a release the fix leaves alone.
        inside = [r for r in _sweep_releases() if SpecifierSet(b["affected"]).contains(r)]
        assert inside and all(r in fixes[b["fix"]].specifiers for r in inside), (b["id"], inside)


def test_the_resume_checks_known_failures_are_catalogued_as_open():
    from mcore_ckpt_fixes.resume.configs import KNOWN_BUG

    by_id = {b["id"]: b for b in known_bugs.load()}
    for bug_id in KNOWN_BUG.values():
        assert by_id[bug_id]["status"] == "open", bug_id
        for rel in ("0.17.1", "0.19.2"):  # where tests/resume reproduces it
            assert SpecifierSet(by_id[bug_id]["affected"]).contains(rel), (bug_id, rel)


def test_the_resume_check_on_torch_adam_needs_the_fix_of_its_catalogued_bug():
    """``moe-ep2-torch-adam`` resumes exactly with torch-adam-step (tests/resume); the failure it
    showed before, ``torch-adam-fresh-load``, is catalogued as fixed by it."""
    from mcore_ckpt_fixes.resume.configs import by_name

    entry = {b["id"]: b for b in known_bugs.load()}["torch-adam-fresh-load"]
    assert (entry["status"], entry["fix"]) == ("fixed", "torch-adam-step")
    assert "torch-adam-step" in by_name("moe-ep2-torch-adam").needs


def _entry(bug_id, affected, status, silent=False):
    detail = {"fix": "tp-group", "how": "tried", "why": "because"}
    field = known_bugs.DETAIL[status]
    return {
        "id": bug_id,
        "symptom": "s",
        "affected": affected,
        "upstream": ["x#1"],
        "status": status,
        "silent": silent,
        field: detail[field],
    }


def test_summary_counts_the_entries_whose_range_holds_the_release():
    bugs = [
        _entry("a", ">=0.16.0,<0.18.0", "fixed"),
        _entry("b", ">=0.17.0,<=0.19.2", "open", silent=True),
        _entry("c", ">=0.18.0", "not-reproduced"),
        _entry("d", "<0.17.0", "not-in-scope"),
        _entry("e", ">=0.17.1,<0.17.2", "guarded"),
    ]
    known_bugs.validate({"bugs": bugs}, ORDER)
    assert known_bugs.summary("0.17.1", bugs) == {
        "fixed": 1,
        "guarded": 1,
        "open": 1,
        "not-in-scope": 0,
        "not-reproduced": 0,
    }
    assert known_bugs.summary("0.18.0", bugs) == {
        "fixed": 0,
        "guarded": 0,
        "open": 1,
        "not-in-scope": 0,
        "not-reproduced": 1,
    }
    assert known_bugs.summary("0.16.1", bugs) == {
        "fixed": 1,
        "guarded": 0,
        "open": 0,
        "not-in-scope": 1,
        "not-reproduced": 0,
    }
    assert known_bugs.status_line("0.17.1", bugs) == (
        "known bugs: 5 catalogued, 3 affect Megatron-Core 0.17.1: 1 fixed, 1 guarded, 1 open, 0 not in scope, "
        "0 not reproduced (docs/known-bugs.md)"
    )
    assert known_bugs.status_line(None, bugs) == "known bugs: 5 catalogued (docs/known-bugs.md)"


def test_status_prints_the_count_for_this_release(mcore_version):
    proc = run_cli(["status", "--no-import"])
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == known_bugs.status_line(mcore_version)
    counts = known_bugs.summary(mcore_version)
    assert f"{sum(counts.values())} affect Megatron-Core {mcore_version}: {counts['fixed']} fixed" in last
    # `status --json` keeps its list of fix rows (tools/status_check.py reads it).
    rows = json.loads(run_cli(["status", "--json", "--no-import"]).stdout)
    assert [r["id"] for r in rows] == list(ORDER)


def test_status_known_bugs_lists_them(mcore_version):
    proc = run_cli(["status", "--known-bugs", "--json"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    expected = known_bugs.affecting(mcore_version)
    assert out["megatron_core"] == str(mcore_version) and out["catalogued"] == len(known_bugs.load())
    assert out["bugs"] == expected and out["summary"] == known_bugs.summary(mcore_version)
    text = run_cli(["status", "--known-bugs"]).stdout.strip().splitlines()
    assert text[0] == known_bugs.status_line(mcore_version)
    assert [ln.split()[0] for ln in text[1:]] == [b["id"] for b in expected]


def test_docs_cli_sample_line_is_the_catalogues():
    with open(os.path.join(ROOT, "docs", "cli.md"), encoding="utf-8") as f:
        sample = [ln for ln in f.read().splitlines() if ln.startswith("known bugs: ")]
    assert sample == [known_bugs.status_line("0.19.2")]


def test_importing_the_package_does_not_read_the_catalogue():
    proc = run_py("import sys, mcore_ckpt_fixes; print('mcore_ckpt_fixes.known_bugs' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    "change, names",
    [
        (lambda d: d["bugs"][3].pop("symptom"), ("entry 3 (mimo-replica-id)", "'symptom'", "missing")),
        (lambda d: d["bugs"][0].update(status="done"), ("entry 0 (tp-group-pg-collection)", "'status'", "'done'")),
        (lambda d: d["bugs"][1].update(fix="mimo"), ("(mimo-optimizer-keyerror)", "'fix'", "'mimo'")),
        (lambda d: d["bugs"][2].update(affected="0.17"), ("(mimo-sharding-type-lost)", "'affected'", "PEP 440")),
        (lambda d: d["bugs"][5].update(id=d["bugs"][4]["id"]), ("entry 5 (mimo-key-collision)", "'id'", "duplicate")),
        (lambda d: d["bugs"][6].update(silent="yes"), ("(gdn-fsdp-double-tp-split)", "'silent'", "'yes'")),
        (lambda d: d["bugs"][0].update(how="x"), ("(tp-group-pg-collection)", "'how'", "'fixed'")),
        (lambda d: d["bugs"][0].update(seen="x"), ("(tp-group-pg-collection)", "'seen'", "unknown field")),
    ],
)
def test_malformed_catalogue_is_one_line_naming_entry_and_field(tmp_path, change, names):
    data = _raw()
    change(data)
    path = tmp_path / "known_bugs.json"
    path.write_text(json.dumps(data))
    with pytest.raises(known_bugs.KnownBugsError) as info:
        known_bugs.load(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith("known_bugs.json: ")
    assert all(n in message for n in names), message


def test_status_with_a_malformed_catalogue_says_so_in_one_line(tmp_path):
    """An edited installation: the fixes are still listed, then one line on stderr and exit 1."""
    shutil.copytree(
        os.path.join(ROOT, "mcore_ckpt_fixes"),
        tmp_path / "mcore_ckpt_fixes",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "mcore_ckpt_fixes" / "known_bugs.json").write_text('{"bugs": [')
    # Run from the copy (python -m puts the working directory first on sys.path).
    proc = run_cli(["status", "--no-import"], {"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert proc.returncode == 1
    assert [ln.split()[0] for ln in proc.stdout.splitlines()[1:] if not ln.startswith("    ")] == list(ORDER)
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("mcore-ckpt-fixes: known_bugs.json: not valid JSON")
