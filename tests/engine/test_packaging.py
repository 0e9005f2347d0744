"""The built wheel: console script, py.typed, the known-bugs catalogue, and the opt-in ``.pth`` activation line."""

import os
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT

pytestmark = pytest.mark.one_line  # the whole matrix runs it on one line (tools/test.sh)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), ROOT],
        check=True,
    )
    (wheel,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)], check=True
    )
    return wheel, target


def _python_with_site(target, code, extra_env):
    # Only the installed copy is visible (not the source tree), and the .pth is processed as at
    # interpreter start by site.addsitedir.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX") and k != "PYTHONPATH"}
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-c", f"import site, sys; site.addsitedir({str(target)!r}); {code}"],
        env=env,
        capture_output=True,
        text=True,
        cwd=str(target),
        check=True,
    ).stdout.strip()


def test_wheel_contents(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "mcore_ckpt_fixes_auto.pth" in names
    assert "mcore_ckpt_fixes/py.typed" in names
    assert "mcore_ckpt_fixes/known_bugs.json" in names  # read by status (package data)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mcore-ckpt-fixes = mcore_ckpt_fixes.__main__:main" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.parametrize("value, active", [(None, False), ("", False), ("0", False), ("1", True)])
def test_pth_activates_only_when_asked(installed, value, active):
    _, target = installed
    env = {} if value is None else {"MCORE_CKPT_FIXES_AUTO": value}
    out = _python_with_site(target, "print('mcore_ckpt_fixes' in sys.modules)", env)
    assert out == str(active)


def test_pth_line_is_a_single_lookup():
    with open(os.path.join(ROOT, "mcore_ckpt_fixes_auto.pth")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os;") and "MCORE_CKPT_FIXES_AUTO" in lines[0]
