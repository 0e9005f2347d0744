"""mcore_ckpt_fixes/other_patches.py where no framework has patched anything: nothing is named, and
every catalogued bug a known patch turns silent is in the catalogue. (ms-swift's real patches:
tests/frameworks/test_ms_swift_other_patches.py, in ms-swift's line.)"""

from __future__ import annotations

import json

import pytest

from conftest import run_py

from mcore_ckpt_fixes import known_bugs, other_patches


def test_silenced_bugs_are_catalogued():
    ids = {b["id"] for b in known_bugs.load()}
    for check in other_patches.CHECKS:
        assert set(check.silences) <= ids, (check.name, sorted(set(check.silences) - ids))


@pytest.mark.one_line
def test_torch_own_checks_are_not_named():
    proc = run_py(
        """
        import json
        import torch.distributed.checkpoint.default_planner, torch.distributed._shard.sharded_tensor.api
        from mcore_ckpt_fixes import other_patches
        print(json.dumps(other_patches.found()))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_a_replaced_check_is_named_with_its_module(monkeypatch):
    """A replacement from outside torch (a function of this test module) is named by its module."""
    import sys
    import types

    module = types.ModuleType(other_patches.CHECKS[0].module)

    def accept_every_plan(*args, **kwargs):
        return []

    module._validate_global_plan = accept_every_plan
    monkeypatch.setitem(sys.modules, other_patches.CHECKS[0].module, module)
    got = [p for p in other_patches.found() if p["check"].endswith("._validate_global_plan")]
    assert got and got[0]["by"] == __name__, got
