"""Other patch layers: ms-swift 4.6.0's ``init_megatron_env`` replaces torch DCP's save-plan validation
and ShardedTensor's overlap check in the process it sets up; ``status`` names both, who made them,
and the catalogued bugs they turn silent (mcore_ckpt_fixes/other_patches.py).

Run in a fresh interpreter (ms-swift's patches are process-wide), with ms-swift really installed
(``tools/test.sh fw-ms-swift``); elsewhere these tests skip, except in ms-swift's own line, where they fail.
"""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_py

NAME = "ms-swift"
PLAN = "torch.distributed.checkpoint.default_planner._validate_global_plan"
OVERLAP = "torch.distributed._shard.sharded_tensor.api.validate_non_overlapping_shards_metadata"

_CODE = """
import io, json, contextlib
import torch.distributed.checkpoint.default_planner, torch.distributed._shard.sharded_tensor.api
from mcore_ckpt_fixes import other_patches
before = other_patches.found()
from mcore_ckpt_fixes.fixes.rng_under_ep.checks.ms_swift import import_swift
import_swift()
from swift.megatron.init import init_megatron_env
init_megatron_env()
after = other_patches.found()
from mcore_ckpt_fixes.cli import status
text = io.StringIO()
with contextlib.redirect_stdout(text):
    status.run(False, True)
as_json = io.StringIO()
with contextlib.redirect_stdout(as_json):
    status.run(True, True, known_bugs=True)
print(json.dumps({"before": before, "after": after, "status": text.getvalue(),
                  "json": json.loads(as_json.getvalue())["other_patches"]}))
"""


@pytest.fixture(scope="module")
def seen():
    from importlib import metadata

    try:
        metadata.version(NAME)
    except metadata.PackageNotFoundError:
        if os.environ.get("MCORE_CKPT_FIXES_FRAMEWORK") == NAME:
            pytest.fail(f"{NAME} is this line's framework but is not installed (tools/envs.sh fw-{NAME})")
        pytest.skip(f"{NAME} not installed here; run tools/test.sh fw-{NAME}")
    proc = run_py(_CODE, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nothing_is_named_before_ms_swift_sets_the_process_up(seen):
    assert seen["before"] == [], seen["before"]


def test_both_replacements_are_found_with_their_owner(seen):
    by_check = {p["check"]: p for p in seen["after"]}
    assert set(by_check) == {PLAN, OVERLAP}, sorted(by_check)
    assert {p["by"] for p in seen["after"]} == {"ms-swift (swift.megatron.init)"}, seen["after"]
    assert by_check[PLAN]["silences"] == [
        "dp-reshardable-padding-past-unpadded-end",
        "nvfp4-dp-reshardable-packed-global-shape",
    ]


def test_status_names_them_and_the_bugs_they_turn_silent(seen):
    text = seen["status"]
    section = text[text.index("other patch layers:") :]
    assert f"active: {PLAN} is replaced by ms-swift" in " ".join(section.split()), section
    assert "dp-reshardable-padding-past-unpadded-end (fixed by dp-reshardable-padding: applied)" in " ".join(
        section.split()
    ), section
    assert "installed: ms-swift 4.6.0:" in section and "(measured)" in " ".join(section.split()), section


def test_status_json_gives_the_same_as_data(seen):
    """``status --known-bugs --json``'s ``other_patches``: both replacements, each silenced bug with
    its state here, and ms-swift as an installed patcher of the measured release."""
    active = {p["check"]: p for p in seen["json"]["active"]}
    assert set(active) == {PLAN, OVERLAP}, sorted(active)
    silenced = {b["id"]: b for b in active[PLAN]["silences"]}
    padding = silenced["dp-reshardable-padding-past-unpadded-end"]
    assert padding["fix"] == "dp-reshardable-padding" and padding["fix_state"] == "applied", padding
    (swift,) = seen["json"]["installed"]
    assert swift["package"] == NAME and swift["version"] == "4.6.0" and swift["measured"] is True, swift
    assert set(swift["replaces"]) == {PLAN, OVERLAP}, swift
