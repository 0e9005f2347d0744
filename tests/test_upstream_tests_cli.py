"""tools/upstream_tests.py refuses to guess: no repository given, or a run in which nothing ran,
ends with one line on stderr and exit 2, never with "0 tests" read as "no outcome differs".

The tool runs as a subprocess with the system ``python3`` (it imports the standard library only).
Its cached environment is a stand-in: a folder whose ``python`` plays torchrun and collects no test,
so the whole path up to the verdict runs in a second, without Megatron-LM or torch.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import types

import pytest

from conftest import ROOT

TOOL = os.path.join(ROOT, "tools", "upstream_tests.py")
RELEASE = "0.19.2"
PYTHON3 = shutil.which("python3") or sys.executable


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_REPO" and not k.startswith("MCORE_CKPT_FIX")}
    env["MCORE_CKPT_FIXES_ENVS"] = str(tmp_path / "envs")
    env.update(extra)
    return env


def _run(args, env):
    return subprocess.run([PYTHON3, TOOL, *args], capture_output=True, text=True, env=env, timeout=120)


def _stand_in_envs(tmp_path):
    """The release's cached environment, as the tool looks for it, whose ``python`` is a torchrun
    that collects nothing: each launch writes an empty list of collected tests and ends."""
    with open(os.path.join(ROOT, "tools", "releases.txt")) as f:
        version = next(ln.split()[1] for ln in f if ln.split()[:1] == [RELEASE])
    bindir = tmp_path / "envs" / f"py{version}" / "bin"
    bindir.mkdir(parents=True)
    (tmp_path / "envs" / f"mcore-{RELEASE}").mkdir()
    python = bindir / "python"
    python.write_text(
        '#!/bin/sh\n: > "$UPSTREAM_TESTS_OUT/collected.$UPSTREAM_TESTS_LAUNCH.rank0.txt"\n'
        ': > "$UPSTREAM_TESTS_OUT/collected.$UPSTREAM_TESTS_LAUNCH.rank1.txt"\nexit 5\n'
    )
    python.chmod(0o755)


def _repo(tmp_path, files):
    """A throwaway git repository holding ``files`` at tag core_v0.19.0."""
    repo = tmp_path / "megatron-lm"
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tests"], check=True)
    subprocess.run([*git, "tag", "core_v0.19.0"], check=True)
    return str(repo)


def _one_line(stderr):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_no_repository_given_is_refused_before_any_work(tmp_path):
    # The stand-in environment is absent: a tool that looked for it first would name it instead.
    result = _run([RELEASE], _env(tmp_path))
    assert result.returncode == 2, result
    line = _one_line(result.stderr)
    assert "--repo" in line and "MEGATRON_LM_REPO" in line, line
    assert result.stdout == ""


def test_megatron_lm_repo_stands_for_repo(tmp_path):
    # Past the repository check: the next refusal is the missing environment.
    result = _run([RELEASE], _env(tmp_path, MEGATRON_LM_REPO=str(tmp_path)))
    assert result.returncode == 2, result
    assert "no environment" in _one_line(result.stderr)


def test_a_tag_without_the_suite_ran_nothing(tmp_path):
    _stand_in_envs(tmp_path)
    repo = _repo(tmp_path, {"README.md": "no tests here\n"})
    result = _run([RELEASE, "--repo", repo], _env(tmp_path))
    assert result.returncode == 2, result
    line = _one_line(result.stderr)
    assert "nothing ran" in line and "core_v0.19.0" in line, line


@pytest.mark.parametrize("only", ["no_such_test", None])
def test_no_test_in_either_mode_ran_nothing(tmp_path, only):
    _stand_in_envs(tmp_path)
    repo = _repo(tmp_path, {"tests/unit_tests/test_optimizer.py": "def test_x():\n    pass\n"})
    result = _run([RELEASE, "--repo", repo, *(["--only", only] if only else [])], _env(tmp_path))
    assert result.returncode == 2, result
    line = _one_line(result.stderr)
    assert line.startswith("upstream_tests: nothing ran"), line
    assert (repr(only) in line) if only else ("no test was collected" in line), line
    assert "outcome differs" not in result.stdout, result.stdout


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("mcore_ckpt_fixes_upstream_tests_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nothing_ran_only_when_both_modes_are_empty(tool):
    empty, some = types.SimpleNamespace(results={}), types.SimpleNamespace(results={"t::a": {0: ("passed", "")}})
    assert tool.nothing_ran(some, some, None) is None
    assert tool.nothing_ran(empty, some, None) is None  # a test in one mode only is a difference, not nothing
    assert tool.nothing_ran(some, empty, "x") is None
    assert "--only 'x'" in tool.nothing_ran(empty, empty, "x")
    assert "no test was collected" in tool.nothing_ran(empty, empty, None)
