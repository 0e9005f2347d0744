"""Every finding carries a next step: ``remedy`` in the JSON, a ``next:`` line in the text."""

import json
import os
import shutil

from ckpt_makers import save_legacy
from conftest import run_cli
from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import inspect
from mcore_ckpt_fixes.doctor.remedies import BY_CODE

TRACKER = "latest_checkpointed_iteration.txt"


def _half_written_next_iteration(root):
    """iter_0000021 copied from iter_0000020 without its .metadata (the last file a save writes);
    the tracker already points at it."""
    done = iter_dir(root)
    shutil.copytree(done, os.path.join(root, "iter_0000021"))
    os.remove(os.path.join(root, "iter_0000021", ".metadata"))
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("21")


def test_incomplete_save_names_the_intact_iteration(saved, copy_of):
    root = copy_of(saved["fsdp"])
    _half_written_next_iteration(root)
    r = inspect(root)
    assert [p["code"] for p in r.problems] == ["incomplete-save"] and r["fallback_iteration"] == 20
    remedy = r.problems[0]["remedy"]
    assert "iter_0000020 is intact: move iter_0000021 aside" in remedy, remedy
    assert f"echo 20 > {os.path.join(root, TRACKER)}" in remedy
    proc = run_cli(["inspect", root])
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("  [incomplete-save]")))
    assert (
        lines[at + 1].startswith("      next: this save did not finish") and "iter_0000020 is intact" in lines[at + 1]
    )


def test_no_intact_iteration_is_said_too(saved, copy_of):
    root = copy_of(saved["fsdp"])
    os.remove(os.path.join(iter_dir(root), ".metadata"))
    r = inspect(root)
    assert r.problems[0]["remedy"].endswith("there is no earlier iteration on disk to resume from")
    shutil.copytree(iter_dir(root), os.path.join(root, "iter_0000021"))  # also without its .metadata
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write("21")
    r = inspect(root)
    assert r.problems[0]["remedy"].endswith("none of the 1 earlier iterations inspected can load either")
    assert r["fallback_iteration"] is None


def test_old_rng_layout_and_data_files_say_what_to_do(saved, copy_of):
    r = inspect(saved["torch_dist"], ep=2)
    rng = next(p for p in r.problems if p["code"] == "rng-2d-under-ep")
    assert "fix rng-under-ep" in rng["remedy"] and "--no-load-rng" in rng["remedy"]
    root = copy_of(saved["torch_dist"])
    os.remove(os.path.join(iter_dir(root), "__1_0.distcp"))
    data = next(p for p in inspect(root, ep=1).problems if p["code"] == "data-files")
    assert data["remedy"].startswith("restore it from a copy") and ".distcp" in data["remedy"]


def test_every_finding_has_a_remedy(saved, copy_of, tmp_path):
    """JSON and text of damaged checkpoints of every format: each problem has its next step."""
    damaged = copy_of(saved["torch_dist"])
    os.remove(os.path.join(iter_dir(damaged), "metadata.json"))
    legacy = os.path.dirname(save_legacy(str(tmp_path / "leg"), 2, 1, 2))
    seen = set()
    for root, extra in (
        (saved["fsdp_collide"], ["--ep", "2"]),
        (damaged, []),
        (legacy, ["--tp", "4", "--pp", "2"]),
        (str(tmp_path / "absent"), []),
    ):
        proc = run_cli(["inspect", root, *extra, "--json"])
        problems = json.loads(proc.stdout)["problems"]
        assert problems and all(p["remedy"] for p in problems), problems
        seen.update(p["code"] for p in problems)
        text = run_cli(["inspect", root, *extra]).stdout
        assert text.count("      next: ") == text.count("\n  ["), text
    assert seen <= set(BY_CODE) and len(seen) >= 6, seen
