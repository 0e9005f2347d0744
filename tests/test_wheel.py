"""The wheel ships what users run, and only that: built from this tree, its files compared with the
rules below (computed from the tree, so a new fix needs no edit here), then installed in a fresh
virtual environment that sees Megatron-Core and torch but not this repository, where ``status`` and
``selftest --fix tp-group`` run as a user runs them.

Shipped: every module under ``mcore_ckpt_fixes/`` (the engine, each fix's declaration, ``runtime/``
and ``checks/`` -- the selftest's round trips --, ``testing/``, ``resume/``, ``cli/``, ``doctor/``,
the catalogue, ``dcp_metadata``), whether its folder has an ``__init__.py`` or is a namespace
package, plus the known-bugs catalogue's data (``known_bugs.json`` and each fix's ``bugs.json``),
``py.typed`` and the ``.pth`` activation line. Left out
(pyproject.toml, ``[tool.hatch.build.targets.wheel] exclude``): each fix's ``diff/`` (the source-diff
builders: tools/patchgen and tests/patches), ``sourcediff.py`` (theirs), each fix's ``doc.md``
(tools/docs.py's input), ``testing/known_bug_repros.py`` (the GPU tests') and ``cli/resume_across.py``
(tools/resume_across.py's). No shipped module may import one of those: that is checked from the source.
"""

from __future__ import annotations

import ast
import json
import os
import re
import site
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, megatron_version

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)

PACKAGE = "mcore_ckpt_fixes"
# Paths under the repository that the wheel leaves out (tools, tests and docs use them, no user's job).
LEFT_OUT = re.compile(
    r"^mcore_ckpt_fixes/("
    r"fixes/[^/]+/diff/.*"  # the source-diff builders, an __init__.py or not
    r"|fixes/[^/]+/doc\.md"
    r"|sourcediff\.py"
    r"|testing/known_bug_repros\.py"
    r"|cli/resume_across\.py"
    r")$"
)
# The package's data files (read at run time, or by type checkers: the known-bugs catalogue, central
# and per fix), and the files beside the package.
DATA = re.compile(r"^mcore_ckpt_fixes/(known_bugs\.json|py\.typed|fixes/[^/]+/bugs\.json)$")
BESIDE = {"mcore_ckpt_fixes_auto.pth"}
# A dotted name built at run time that ends in, or goes through, a diff package (f"{home}.diff",
# "diff", ".diff.core"): prose has spaces, these do not.
DIFF = re.compile(r"(?:[\w.]*\.)?diff(?:\.[\w.]*)?")
TIMEOUT = 300


def _tree_files():
    """Every file of the package in this tree, as ``a/b.py`` (bytecode caches aside)."""
    for folder, dirs, files in os.walk(os.path.join(ROOT, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith((".pyc", ".pyo")):
                yield os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")


def _expected():
    """The rules: every module of the package and the data files, less what LEFT_OUT names."""
    kept = {p for p in _tree_files() if (p.endswith(".py") or DATA.match(p)) and not LEFT_OUT.match(p)}
    return kept | BESIDE


def _build(out):
    # Offline and with this environment's hatchling (pyproject's build backend): no index, no isolation.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["-w", str(out), ROOT],
        check=True,
        timeout=TIMEOUT,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("wheel"))


def _installed_files(wheel):
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")]
    return {n for n in names if ".dist-info/" not in n}


def test_wheel_ships_the_runtime_and_leaves_the_rest_out(wheel):
    """The wheel's files are exactly the rules' (both directions: nothing user-facing missing, no
    development file shipped); the rules must also leave something out, or they name nothing here."""
    shipped, expected = _installed_files(wheel), _expected()
    assert not expected - shipped, f"missing from the wheel: {sorted(expected - shipped)}"
    assert not shipped - expected, (
        f"shipped but not by the rules (pyproject.toml exclude?): {sorted(shipped - expected)}"
    )
    assert any(LEFT_OUT.match(p) for p in _tree_files())
    assert any(p.endswith("/bugs.json") for p in expected)  # the fixes' catalogue entries (status reads them)


def test_wheel_is_reproducible(wheel, tmp_path):
    """Two builds of the same tree are the same bytes (hatchling's fixed timestamps, sorted walk)."""
    assert _build(tmp_path).read_bytes() == wheel.read_bytes()


def _module(path):
    """``a/b/__init__.py`` -> ``a.b``; ``a/b/c.py`` -> ``a.b.c``."""
    name = path[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _named(path, nodes):
    """(line, name) for each module ``path``'s nodes import (function-level imports too; relative ones
    resolved; ``from X import y`` gives both ``X`` and ``X.y``, y may be a submodule) and each string."""
    package = _module(path) if path.endswith("/__init__.py") else _module(path).rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def test_no_shipped_module_imports_what_the_wheel_leaves_out():
    """A user's installation would raise ModuleNotFoundError there: only tools and tests may import
    the left-out modules. Module names given as strings (importlib, f-strings' parts) are caught too."""
    files = list(_tree_files())
    left_out = {_module(p) for p in files if p.endswith(".py") and LEFT_OUT.match(p)}
    # A diff/ folder without an __init__.py is still a (namespace) package that can be imported.
    left_out |= {_module(p).rpartition(".")[0] for p in files if re.match(r"^mcore_ckpt_fixes/fixes/[^/]+/diff/", p)}
    named = re.compile(r"\b(" + "|".join(re.escape(m) for m in sorted(left_out)) + r")\b")
    found = []
    for path in files:
        if not path.endswith(".py") or LEFT_OUT.match(path):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            nodes = ast.walk(ast.parse(f.read(), path))
        found += [
            f"{path}:{line}: {name!r}"
            for line, name in _named(path, nodes)
            if named.search(name) or DIFF.fullmatch(name)
        ]
    assert not found, "shipped modules naming left-out ones:\n" + "\n".join(found)


def _environment_paths():
    """What this test's interpreter sees besides the repository: PYTHONPATH's other entries (the
    cached Megatron-Core line, tools/test.sh), then its site-packages (torch, packaging, numpy)."""
    root = os.path.realpath(ROOT)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + site.getsitepackages()
    real = [os.path.realpath(p) for p in dict.fromkeys(paths) if os.path.isdir(p)]
    return [p for p in real if p != root and not p.startswith(root + os.sep)]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    """A fresh virtual environment with the wheel installed: a plain venv (no pip, so quick) whose
    site-packages gets a .pth naming the environment's paths (plain path lines: no .pth there runs,
    so an editable install of this repository would stay invisible), and the wheel installed into it
    by this environment's pip (``--python``), offline."""
    where = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=TIMEOUT)
    python = str(where / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=TIMEOUT,
        env=_user_env(),
    ).stdout.strip()
    with open(os.path.join(purelib, "cached_environment.pth"), "w") as f:
        f.write("".join(p + "\n" for p in _environment_paths()))
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=TIMEOUT,
    )
    return where, python


def _user_env():
    """This environment as a user's shell would have it: no PYTHONPATH (it names the repository) and
    no fix flags."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("MCORE_CKPT_FIX")}


def _run(python, args, cwd):
    """Run in the venv from a folder outside the repository (``-m`` puts the cwd first on sys.path)."""
    return subprocess.run(
        [python, *args], capture_output=True, text=True, cwd=str(cwd), env=_user_env(), timeout=TIMEOUT
    )


def test_installed_wheel_runs_outside_the_repository(venv, tmp_path):
    """The installed package is the venv's copy (not this tree), without the left-out modules, and
    its CLI works from it: ``status`` lists every fix on this environment's Megatron-Core, and
    ``selftest --fix tp-group`` passes its round trips (the checks/ and testing/ modules the wheel
    keeps), saying whether this release needs the fix as ``status`` does."""
    where, python = venv
    probe = (
        "import importlib.metadata as m, importlib.util as u, json, mcore_ckpt_fixes as p;"
        "print(json.dumps({'file': p.__file__, 'version': m.version('mcore-ckpt-fixes'),"
        " 'left_out': [n for n in ('mcore_ckpt_fixes.sourcediff', 'mcore_ckpt_fixes.testing.known_bug_repros',"
        " 'mcore_ckpt_fixes.cli.resume_across', 'mcore_ckpt_fixes.fixes.tp_group.diff') if u.find_spec(n)]}))"
    )
    found = _run(python, ["-c", probe], tmp_path)
    assert found.returncode == 0, found.stderr
    found = json.loads(found.stdout)
    assert os.path.realpath(found["file"]).startswith(os.path.realpath(where) + os.sep), found["file"]
    assert found["left_out"] == [] and found["version"]

    from mcore_ckpt_fixes.fixes import ORDER

    status = _run(python, ["-m", PACKAGE, "status"], tmp_path)
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith(f"mcore-ckpt-fixes {found['version']}; Megatron-Core {megatron_version()} ")
    for fix_id in ORDER:
        assert re.search(rf"^  {re.escape(fix_id)} +\S", status.stdout, re.M), f"status does not list {fix_id}"
    state = re.search(r"^  tp-group +(\S+)", status.stdout, re.M).group(1)
    assert state in ("applied", "not-needed"), status.stdout

    selftest = _run(python, ["-m", PACKAGE, "selftest", "--fix", "tp-group"], tmp_path)
    out = selftest.stdout
    assert selftest.returncode == 0, out + selftest.stderr
    assert f"Megatron-Core {megatron_version()} " in out and "only --fix tp-group" in out
    needed = "yes" if state == "applied" else "no"
    assert f"needed by this release: {needed} ({state}; affected " in out, out
    assert re.search(r"^selftest: PASS in ", out, re.M), out
