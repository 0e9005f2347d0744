"""tools/new_fix.py, run on a copy of the files it reads and edits: it writes a skeleton that imports,
is found by the engine and the scenario registry, lists itself last in ORDER, adds a CHANGELOG line,
and that the generic tests report as unwritten; bad input gets one line and exit 2, nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "fixes"))
from test_every_fix import unwritten_files  # noqa: E402

NEW = "example-strict-check"
MODULE = "megatron.core.dist_checkpointing.validation"


@pytest.fixture
def tree(tmp_path):
    """A repository copy holding what the tool reads and edits (the package, CHANGELOG, itself)."""
    shutil.copytree(
        os.path.join(ROOT, "mcore_ckpt_fixes"),
        tmp_path / "mcore_ckpt_fixes",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    (tmp_path / "tools").mkdir()
    (tmp_path / "tests" / "fixes").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tools", "new_fix.py"), tmp_path / "tools")
    shutil.copy(os.path.join(ROOT, "CHANGELOG.md"), tmp_path)
    return tmp_path


def _run(tree, *args):
    return subprocess.run(
        [sys.executable, str(tree / "tools" / "new_fix.py"), *args],
        capture_output=True,
        text=True,
        cwd=tree,
        timeout=60,
    )


def test_writes_a_skeleton_the_engine_finds(tree):
    done = _run(tree, NEW, MODULE, "--function", "_determine_missing_and_unexpected_keys")
    assert done.returncode == 0, done.stderr
    pkg = NEW.replace("-", "_")
    home = tree / "mcore_ckpt_fixes" / "fixes" / pkg
    for rel in ("__init__.py", "runtime/core.py", "checks/scenarios.py", "checks/core.py", "doc.md", "bugs.json"):
        assert (home / rel).is_file(), rel
    assert (tree / "tests" / "fixes" / f"test_{pkg}.py").is_file()
    changelog = (tree / "CHANGELOG.md").read_text()
    # A line of its own, the first of the Unreleased section's Added list, the entries after it intact.
    after = changelog.split("## [Unreleased]", 1)[1].split("### Added\n", 1)[1].lstrip("\n").splitlines()
    assert after[0].startswith(f"- `{NEW}`: NOT WRITTEN YET") and after[1].startswith("- "), after[:2]
    check = (
        "from mcore_ckpt_fixes.engine.registry import ENGINE\n"
        "from mcore_ckpt_fixes.testing import for_fix\n"
        f"fixes = ENGINE.discover(); assert list(fixes)[-1] == {NEW!r}, list(fixes)\n"
        f"t = fixes[{NEW!r}].targets[0]; assert t.runtime.endswith('{pkg}.runtime.core'), t.runtime\n"
        f"assert [s.name for s in for_fix({NEW!r})] == ['round_trip']\n"
        f"import mcore_ckpt_fixes.fixes.{pkg}.checks.core, mcore_ckpt_fixes.fixes.{pkg}.runtime.core\n"
    )
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != ROOT]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *inherited]))  # the copy, not the repository
    ran = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tree, env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    # What the generic test says of it: every file the scaffold wrote still needs the bug's knowledge.
    left = unwritten_files(str(tree), NEW)
    assert len(left) == 7 and f"tests/fixes/test_{pkg}.py" in left, left


@pytest.mark.parametrize(
    "args,named",
    [
        (("My_Fix", MODULE), "fix id 'My_Fix'"),
        (("my-fix", "validation"), "module 'validation'"),
        (("my-fix", MODULE, "--function", "not a name"), "--function 'not a name'"),
        (("rerun-state-strict-load", MODULE), "exists already"),
    ],
)
def test_bad_input_one_line_exit_2_nothing_written(tree, args, named):
    before = sorted(os.listdir(tree / "mcore_ckpt_fixes" / "fixes"))
    order = (tree / "mcore_ckpt_fixes" / "fixes" / "__init__.py").read_text()
    done = _run(tree, *args)
    assert done.returncode == 2 and named in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(os.listdir(tree / "mcore_ckpt_fixes" / "fixes")) == before
    assert (tree / "mcore_ckpt_fixes" / "fixes" / "__init__.py").read_text() == order
