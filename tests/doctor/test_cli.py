"""``mcore-ckpt-fixes inspect`` as a user runs it: exit codes, the JSON contract, one-line errors."""

import json
import os

from conftest import run_cli, run_py
from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)


def _json(proc):
    return json.loads(proc.stdout)


def test_clean_checkpoint_exit_0(saved):
    proc = run_cli(["inspect", saved["torch_dist"], "--ep", "1"])  # saved with EP=2: see test_dcp
    assert proc.returncode == 0, proc.stderr
    assert "format:     torch_dist" in proc.stdout and proc.stdout.rstrip().endswith("no problems found")


def test_json_contract(saved, tmp_path):
    proc = run_cli(["inspect", saved["fsdp_collide"], "--json", "--ep", "2"])
    assert proc.returncode == 1 and proc.stderr == ""
    d = _json(proc)
    assert d["format"] == "fsdp_dtensor" and d["iteration"] == 20
    assert [p["code"] for p in d["problems"]] == ["expert-key-collision", "rng-2d-under-ep"]
    assert all(set(p) >= {"code", "message"} for p in d["problems"])
    assert d["coverage_problems"] == [] and len(d["expert_problems"]) == 1 and "readable_by" in d

    from ckpt_makers import save_legacy

    root = os.path.dirname(save_legacy(str(tmp_path / "leg"), 2, 1, 2))
    d = _json(run_cli(["inspect", root, "--json", "--tp", "2", "--pp", "1", "--ep", "2"]))
    assert (d["format"], d["layout"], d["loader"]) == ("torch", "2D", "ep-aware")
    assert d["expected"] == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert d["missing"] == d["extra"] == [] and d["problems"] == []


def test_unreadable_and_bad_usage_exit_2(saved, copy_of, tmp_path):
    root = copy_of(saved["torch_dist"])
    with open(os.path.join(iter_dir(root), ".metadata"), "r+b") as f:
        f.truncate(100)
    for args in (
        ["inspect", root],
        ["inspect", str(tmp_path / "absent")],
        ["inspect", root, "--tp", "0"],
        ["inspect", str(tmp_path)],
    ):
        proc = run_cli(args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    proc = run_cli(["inspect", root, "--json"])
    assert proc.returncode == 2 and _json(proc)["problems"][0]["code"] == "unreadable"
    assert "truncated or corrupt" in proc.stderr


def test_doctor_imports_only_on_inspect():
    """`import mcore_ckpt_fixes` does not load the doctor; the doctor loads no fix, no torch, no Megatron."""
    out = run_py("""
        import sys
        import mcore_ckpt_fixes
        assert "mcore_ckpt_fixes.doctor" not in sys.modules
        before = set(sys.modules)
        import mcore_ckpt_fixes.doctor
        added = set(sys.modules) - before
        heavy = sorted(m for m in added if m.split(".")[0] in ("torch", "megatron", "numpy")
                       or m.startswith(("mcore_ckpt_fixes.fixes", "mcore_ckpt_fixes.engine", "mcore_ckpt_fixes.testing")))
        print(heavy)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def tree_state(root):
    """Every file and directory under ``root`` with its size, mtime and bytes: what a read-only
    command must leave exactly as it found it."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            content = open(path, "rb").read() if os.path.isfile(path) else None
            state[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, st.st_mode, content)
    return state


def test_inspect_modifies_nothing(saved, copy_of, tmp_path):
    """Clean, damaged and legacy checkpoints, text and JSON: the tree is byte-for-byte unchanged."""
    from ckpt_makers import save_legacy

    damaged = copy_of(saved["torch_dist"])
    os.remove(os.path.join(iter_dir(damaged), "metadata.json"))
    legacy = os.path.dirname(save_legacy(str(tmp_path / "leg"), 2, 1, 2))
    for root, extra in (
        (saved["torch_dist"], []),
        (saved["fsdp_collide"], ["--ep", "2"]),
        (damaged, []),
        (legacy, ["--tp", "2", "--pp", "2"]),
    ):
        before = tree_state(root)
        for fmt in ([], ["--json"]):
            proc = run_cli(["inspect", root, *extra, *fmt])
            assert proc.returncode in (0, 1, 2), proc.stderr
        assert tree_state(root) == before, root


def test_saved_ep_flags_old_rng_layout_without_flags(saved):
    proc = run_cli(["inspect", saved["torch_dist"]])
    assert proc.returncode == 1 and "[rng-2d-under-ep]" in proc.stdout and "ep=2 (saved args in " in proc.stdout


def test_damaged_and_unsafe_copies_exit_1_and_stay_unchanged(saved, copy_of, tmp_path):
    """Damaged and planted copies: exit 1 in text and JSON, nothing run, every byte left as it was."""
    import pickle

    from ckpt_makers import save_legacy

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    cut = os.path.dirname(save_legacy(str(tmp_path / "cut"), 2, 1, 1))
    with open(os.path.join(iter_dir(cut), "mp_rank_01", "model_optim_rng.pt"), "r+b") as f:
        f.truncate(300)
    raw = os.path.dirname(save_legacy(str(tmp_path / "raw"), 1, 1, 1))
    with open(os.path.join(iter_dir(raw), "mp_rank_00", "model_optim_rng.pt"), "wb") as f:
        pickle.dump({"args": Evil()}, f, protocol=2)
    empty_common = copy_of(saved["torch_dist"])
    open(os.path.join(iter_dir(empty_common), "common.pt"), "wb").close()
    planted_index = str(tmp_path / "index")
    import shutil

    shutil.copytree(saved["fsdp"], planted_index)
    with open(os.path.join(iter_dir(planted_index), ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    for root, code in (
        (cut, "damaged-file"),
        (raw, "unsafe-pickle"),
        (empty_common, "damaged-file"),
        (planted_index, "unsafe-pickle"),
    ):
        before = tree_state(root)
        for fmt in ([], ["--json"]):
            proc = run_cli(["inspect", root, "--ep", "1", *fmt])
            assert proc.returncode == 1 and code in proc.stdout and proc.stderr == "", (root, proc.stdout, proc.stderr)
        assert tree_state(root) == before, root
    assert not marker.exists()
