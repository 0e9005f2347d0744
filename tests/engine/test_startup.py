"""Start-up touches nothing: applying every fix (each target module imported and each probe run on
this release's own code, as ``status`` does) writes nothing to the file system from this package,
not even a scratch file it removes again, and fails no fix. Watched with an audit hook in a child
(tests/engine/startup_child.py): every open for writing, mkdir, rename, remove made while a frame
of mcore_ckpt_fixes is on the stack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, child_env


def test_applying_every_fix_writes_nothing():
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup_child.py")
    proc = subprocess.run(
        [sys.executable, child], env=child_env([ROOT], None), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["writes"] == [], out["writes"]
    assert not [f for f, s in out["states"].items() if s == "failed"], out["states"]
    assert "applied" in out["states"].values(), out["states"]  # the probes really ran
