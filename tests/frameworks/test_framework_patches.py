"""Every committed framework diff (``patches/<fix>/<dist>-<version>.patch``) is what the fix's diff
module renders today from that framework's released file: a change to a fix's runtime that its
framework diff carries (a helper's text) cannot leave the committed diff behind. Runs in the line
of the framework installed here (``tools/test.sh fw-<name>``); the diffs' behaviour (applied to the
released source, round trip with the monkeypatch off) is each framework's own test file's."""

from __future__ import annotations

import glob
import os
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FRAMEWORK = os.environ.get("MCORE_CKPT_FIXES_FRAMEWORK")


def _framework_patches():
    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "patches", "*", "*.patch"))):
        dist, _, version = os.path.basename(path)[: -len(".patch")].rpartition("-")
        if dist:
            found.append(pytest.param(path, dist, version, id=f"{os.path.basename(os.path.dirname(path))}-{dist}"))
    return found


@pytest.mark.parametrize("path,dist,version", _framework_patches())
def test_committed_framework_patch_is_what_the_diff_renders(path, dist, version):
    if FRAMEWORK != dist:
        pytest.skip(f"{dist}'s diff is checked in its own line (tools/test.sh fw-{dist})")
    from mcore_ckpt_fixes.sourcediff import fix_edits, render

    installed = metadata.version(dist)
    assert installed == version, f"{dist} {installed} is installed, the diff is for {version}"
    fix_id = os.path.basename(os.path.dirname(path))
    src_root = str(metadata.distribution(dist).locate_file(""))
    with open(path, encoding="utf-8") as f:
        assert render(src_root, fix_edits(fix_id, f"{dist}-{version}")) == f.read(), path
