"""Tracker file against iter_* directories (on a real torch_dist save of this release)."""

import os

from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import Unreadable, inspect

import pytest


def codes(r):
    return [p["code"] for p in r.problems]


def test_tracker_points_at_missing_iteration(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2000\n")
    r = inspect(root)
    assert codes(r) == ["tracker-missing-iteration"] and r["iteration"] == 2000
    assert r.problems[0]["message"] == (
        "latest_checkpointed_iteration.txt says 2000 but iter_0002000 does not exist: "
        "Megatron fails to load (on disk: iter_0000010)"
    )


def test_tracker_missing_is_a_silent_restart(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    os.remove(os.path.join(root, "latest_checkpointed_iteration.txt"))
    r = inspect(root, ep=1)  # saved with EP=2: a run at EP=1 sees only the tracker
    assert codes(r) == ["tracker-missing"] and r["iteration"] == 10 and r["format"] == "torch_dist"
    assert "starts from scratch" in r.problems[0]["message"]


def test_tracker_invalid_and_iteration_flag(saved, copy_of):
    root = copy_of(saved["torch_dist"])
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("latest")
    assert codes(inspect(root, ep=1)) == ["tracker-invalid"]
    r = inspect(saved["torch_dist"], iteration=10, ep=1)
    assert r.ok and r["iteration"] == 10
    assert codes(inspect(saved["torch_dist"], iteration=11, ep=1)) == ["iteration-missing"]


def test_iteration_directory_given_directly(saved):
    r = inspect(iter_dir(saved["torch_dist"]), ep=1)
    assert r.ok and r["iteration"] == 10 and "tracker" not in r.data


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(Unreadable, match="is not a Megatron checkpoint"):
        inspect(str(tmp_path))
    with pytest.raises(Unreadable, match="no such directory"):
        inspect(str(tmp_path / "absent"))


def test_newer_iterations_than_the_tracker_are_named_with_what_they_lack(saved, copy_of):
    """A save that died halfway (data files, no .metadata) and one that finished but was never
    recorded in the tracker: both named, the checkpoint itself still clean (Megatron loads the
    tracker's iteration). The resume after a rank killed mid-save: tests/resume/test_interrupted_save.py."""
    import shutil

    root = copy_of(saved["torch_dist"])
    died, unrecorded = os.path.join(root, "iter_0000020"), os.path.join(root, "iter_0000030")
    shutil.copytree(os.path.join(root, "iter_0000010"), unrecorded)
    os.makedirs(died)
    for name in sorted(os.listdir(unrecorded)):
        if name.endswith(".distcp") and name.startswith("__1_"):
            shutil.copy(os.path.join(unrecorded, name), died)
    r = inspect(root, ep=1)
    assert r.ok and r["iteration"] == 10, r.problems
    assert [(n["iteration"], n["complete"]) for n in r["newer_iterations"]] == [(20, False), (30, True)]
    assert r["newer_iterations"][0]["state"] == (
        "incomplete: data files of 1 rank, no .metadata, no metadata.json (the save stopped before its "
        "coordinator finished)"
    )
    assert "iter_0000030, newer than the tracker's: a finished save the tracker does not record" in " ".join(r.notes)
