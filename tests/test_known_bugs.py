"""The known-bugs catalogue (each fix's entries in mcore_ckpt_fixes/fixes/<fix>/bugs.json, the others in
mcore_ckpt_fixes/known_bugs.json): well formed, consistent with the fixes, counted right for a release,
printed by ``status``, and a malformed file named in one line."""

import json
import os
import shutil

import pytest
from packaging.specifiers import SpecifierSet

from conftest import ROOT, run_cli, run_py
from mcore_ckpt_fixes import known_bugs
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.fixes import ORDER


def _raw(path=known_bugs.PATH):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _fix_file(fix_id, fixes_dir=known_bugs.FIXES_DIR):
    return os.path.join(fixes_dir, fix_id.replace("-", "_"), "bugs.json")


def _sweep_releases():
    with open(os.path.join(ROOT, "tools", "sweep-releases.txt")) as f:
        return [ln.split()[0] for ln in f if ln.strip() and not ln.startswith("#")]


def test_catalogue_is_well_formed():
    bugs = known_bugs.load()
    # The fixes' files in ORDER, each entry given its fix, then the central file's.
    from_files = [
        {**b, "fix": fix_id}
        for fix_id in ORDER
        if os.path.isfile(_fix_file(fix_id))
        for b in _raw(_fix_file(fix_id))["bugs"]
    ]
    assert bugs == from_files + _raw()["bugs"] and len(bugs) >= 30
    assert all(b["status"] not in ("fixed", "guarded") and "fix" not in b for b in _raw()["bugs"])
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
    # No framework here has patched a check (ms-swift's own line: tests/frameworks).
    assert out["other_patches"]["active"] == [], out["other_patches"]
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


def _copy_catalogue(tmp_path):
    """The catalogue's files under ``tmp_path``: (central file, fixes folder) for :func:`known_bugs.load`."""
    os.makedirs(tmp_path, exist_ok=True)
    for fix_id in ORDER:
        if os.path.isfile(_fix_file(fix_id)):
            os.makedirs(os.path.dirname(_fix_file(fix_id, tmp_path / "fixes")))
            shutil.copy(_fix_file(fix_id), _fix_file(fix_id, tmp_path / "fixes"))
    shutil.copy(known_bugs.PATH, tmp_path / "known_bugs.json")
    return str(tmp_path / "known_bugs.json"), str(tmp_path / "fixes")


def _edit(path, change):
    data = _raw(path)
    change(data)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def _refused(tmp_path, edits):
    """The message of the error ``load`` raises after ``edits`` ({file: change}, ``None`` for the
    central file, a fix id for that fix's file); it is one line."""
    central, fixes_dir = _copy_catalogue(tmp_path)
    for where, change in edits.items():
        _edit(central if where is None else _fix_file(where, fixes_dir), change)
    with pytest.raises(known_bugs.KnownBugsError) as info:
        known_bugs.load(central, fixes_dir)
    message = str(info.value)
    assert "\n" not in message, message
    return message


MIMO = "fixes/mimo_optimizer/bugs.json: "
TP = "fixes/tp_group/bugs.json: "


@pytest.mark.parametrize(
    "where, change, names",
    [
        (
            "mimo-optimizer",
            lambda d: d["bugs"][2].pop("symptom"),
            (MIMO + "entry 2 (mimo-replica-id)", "'symptom'", "missing"),
        ),
        (
            "tp-group",
            lambda d: d["bugs"][0].update(status="done"),
            (TP + "entry 0 (tp-group-pg-collection)", "'status'", "'done'"),
        ),
        (
            "mimo-optimizer",
            lambda d: d["bugs"][1].update(affected="0.17"),
            (MIMO + "entry 1 (mimo-sharding-type-lost)", "'affected'", "PEP 440"),
        ),
        (
            "mimo-optimizer",
            lambda d: d["bugs"][4].update(id=d["bugs"][3]["id"]),
            (MIMO + "entry 4 (mimo-key-collision)", "'id'", "duplicate", "also " + MIMO[:-2] + " entry 3"),
        ),
        (
            "gdn-fsdp-split",
            lambda d: d["bugs"][0].update(silent="yes"),
            ("fixes/gdn_fsdp_split/bugs.json: ", "(gdn-fsdp-double-tp-split)", "'silent'", "'yes'"),
        ),
        ("tp-group", lambda d: d["bugs"][0].update(how="x"), (TP, "(tp-group-pg-collection)", "'how'", "'fixed'")),
        (
            "tp-group",
            lambda d: d["bugs"][0].update(seen="x"),
            (TP, "(tp-group-pg-collection)", "'seen'", "unknown field"),
        ),
        (None, lambda d: d["bugs"][0].pop("how"), ("known_bugs.json: entry 0", "'how'", "non-empty string")),
        (None, lambda d: d["bugs"][1].update(status="done"), ("known_bugs.json: entry 1", "'status'", "'done'")),
        (None, lambda d: d["bugs"][2].update(why="x"), ("known_bugs.json: entry 2", "'why'", "'not-reproduced'")),
        (None, lambda d: d.update(bugs={}), ("known_bugs.json: ", "a list 'bugs'")),
        ("tp-group", lambda d: d.update(bugs=None), (TP, "a list 'bugs'")),
    ],
)
def test_malformed_catalogue_is_one_line_naming_file_entry_and_field(tmp_path, where, change, names):
    message = _refused(tmp_path, {where: change})
    assert message.startswith(names[0]) and all(n in message for n in names), message


def test_a_fix_field_in_a_fix_folder_is_refused(tmp_path):
    """The folder names the fix: an entry there that names one too (the same or another) is an error."""
    for fix in ("tp-group", "mimo-optimizer"):
        message = _refused(tmp_path / fix, {"tp-group": lambda d, fix=fix: d["bugs"][0].update(fix=fix)})
        assert message.startswith(TP + "entry 0 (tp-group-pg-collection): field 'fix': "), message
        assert "folder" in message, message


@pytest.mark.parametrize("status", ["open", "not-in-scope", "not-reproduced"])
def test_a_fix_folder_holds_only_fixed_or_guarded_entries(tmp_path, status):
    detail = known_bugs.DETAIL[status]
    message = _refused(tmp_path, {"tp-group": lambda d: d["bugs"][0].update(status=status, **{detail: "x"})})
    assert message.startswith(TP + "entry 0 (tp-group-pg-collection): field 'status': "), message
    assert repr(status) in message and "known_bugs.json" in message, message


def test_a_fixed_entry_in_the_central_file_is_refused(tmp_path):
    """An entry a fix covers lives in that fix's folder; the message names the folder's file."""

    def fixed_by_tp_group(d):
        d["bugs"][0].pop("how")
        d["bugs"][0].update(status="fixed", fix="tp-group")

    message = _refused(tmp_path, {None: fixed_by_tp_group})
    assert message.startswith("known_bugs.json: entry 0 ("), message
    assert "'status'" in message and "fixes/tp_group/bugs.json" in message, message


def test_a_duplicate_id_across_files_names_both_places(tmp_path):
    central = _raw()
    first = central["bugs"][0]["id"]
    # A fix's file and the central file: the fixes' files are read first, so the central entry is the second.
    message = _refused(tmp_path / "central", {"tp-group": lambda d: d["bugs"][0].update(id=first)})
    assert message.startswith(f"known_bugs.json: entry 0 ({first}): field 'id': duplicate id"), message
    assert f"also {TP[:-2]} entry 0" in message, message
    # Two fixes' files: the one later in ORDER is named first.
    message = _refused(
        tmp_path / "fixes", {"mimo-optimizer": lambda d: d["bugs"][0].update(id="tp-group-pg-collection")}
    )
    assert message.startswith(MIMO + "entry 0 (tp-group-pg-collection): field 'id': duplicate id"), message
    assert f"also {TP[:-2]} entry 0" in message, message


def test_a_fix_folder_without_bugs_is_fine_and_a_stray_file_is_not(tmp_path):
    central, fixes_dir = _copy_catalogue(tmp_path)
    os.remove(_fix_file("tp-group", fixes_dir))
    bugs = known_bugs.load(central, fixes_dir)
    assert "tp-group-pg-collection" not in {b["id"] for b in bugs} and len(bugs) == len(known_bugs.load()) - 1
    # A folder that is no fix of ORDER: its entries would never be read.
    os.makedirs(os.path.join(fixes_dir, "no_such_fix"))
    shutil.copy(_fix_file("mimo-optimizer"), os.path.join(fixes_dir, "no_such_fix", "bugs.json"))
    with pytest.raises(known_bugs.KnownBugsError) as info:
        known_bugs.load(central, fixes_dir)
    assert str(info.value).startswith("fixes/no_such_fix/bugs.json: 'no-such-fix' is not a fix"), str(info.value)


def test_a_fix_file_that_is_not_json_is_named(tmp_path):
    central, fixes_dir = _copy_catalogue(tmp_path)
    with open(_fix_file("mimo-optimizer", fixes_dir), "w") as f:
        f.write('{"bugs": [')
    with pytest.raises(known_bugs.KnownBugsError) as info:
        known_bugs.load(central, fixes_dir)
    assert str(info.value).startswith(MIMO + "not valid JSON"), str(info.value)


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
