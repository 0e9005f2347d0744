"""patches/mimo-optimizer: the source-patched ``dist_checkpointing.load`` reads what unfixed 0.17/0.18
wrote, as the monkeypatch does (tests/fixes/test_mimo_matrix.py covers the monkeypatch).

The old-layout checkpoint is written by a pristine, unfixed Megatron-Core (MCORE_CKPT_FIXES=off):
this release's own on 0.17.1 and 0.18.2; on 0.19.2, whose own save already writes the new layout,
0.18.2's environment writes it. Configuration ``mixed`` (language: non-distributed optimizer,
vision: DistributedOptimizer ``dp_reshardable``), the one unfixed 0.17/0.18 can save non-colocated.
Then this release's Megatron-Core with patches/mimo-optimizer/<release>.patch applied, monkeypatch
off, loads it: every optimizer state tensor, param-group field and sharding type exact on both
ranks, and one plain UserWarning per rank naming the old layout.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, envs_dir

DRIVER = os.path.join(ROOT, "tests", "fixes", "mimo_matrix_driver.py")
MIXED = {"language": "non_distributed", "vision": "dp_reshardable"}
OLD_LAYOUT_WRITER = {"0.17.1": "0.17.1", "0.18.2": "0.18.2", "0.19.2": "0.18.2"}


def _drive(python, megatron_root, jobs, workdir, name):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    env.update(PYTHONPATH=os.pathsep.join([megatron_root, ROOT]), PYTHONDONTWRITEBYTECODE="1", MCORE_CKPT_FIXES="off")
    jobs_path, out_path = os.path.join(workdir, f"{name}.jobs.json"), os.path.join(workdir, f"{name}.out.json")
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)
    proc = subprocess.run([python, DRIVER, jobs_path, out_path], env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_path) as f:
        return json.load(f)[0]["ranks"]


def test_source_patch_reads_the_old_mimo_layout(mcore_version, tmp_path):
    release = str(mcore_version)
    if release not in OLD_LAYOUT_WRITER:
        pytest.skip(f"no patches/mimo-optimizer diff for {release} (no megatron.core.models.mimo)")
    writer = OLD_LAYOUT_WRITER[release]
    envs = envs_dir()
    writer_root = os.path.join(envs, f"mcore-{writer}")
    if not os.path.isdir(writer_root):
        pytest.fail(f"needs the Megatron-Core {writer} environment: build it with tools/envs.sh {writer}")
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    # Both 0.17+ environments share the Python 3.12 interpreter; this one is it.
    saved = _drive(
        sys.executable,
        writer_root,
        [{"mode": "save", "ckpt_dir": ckpt, "patched": False, "sharding_type": MIXED}],
        str(tmp_path),
        "save",
    )
    for rank, r in enumerate(saved):
        assert r["ok"] and r["error"] is None, (rank, r.get("error") or r.get("crash"))
        assert r["fix_state"] == {"megatron.core.models.mimo.optimizer": "disabled"}, r["fix_state"]

    from mcore_ckpt_fixes.engine.version import detect

    pristine = detect().path  # this environment's unpacked wheel: .../megatron
    patched_root = tmp_path / "patched"
    shutil.copytree(pristine, patched_root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    patch_file = os.path.join(ROOT, "patches", "mimo-optimizer", f"{release}.patch")
    proc = subprocess.run(
        ["patch", "-p1", "--forward", "-i", patch_file], cwd=patched_root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    loaded = _drive(
        sys.executable,
        str(patched_root),
        [{"mode": "load", "ckpt_dir": ckpt, "patched": False, "sharding_type": MIXED}],
        str(tmp_path),
        "load",
    )
    assert [r.get("module") for r in loaded] == ["language", "vision"], loaded
    for rank, r in enumerate(loaded):
        assert r["ok"] and r["error"] is None, (rank, r.get("error") or r.get("crash"), r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["bad_groups"] == [], (rank, r["bad_groups"])
        assert r["sharding_type"] == (None if r["module"] == "language" else "dp_reshardable"), r["sharding_type"]
        assumed = (
            "; not stored there (0.17 keeps it in the common state, which only global rank 0 writes), so "
            "taken from this load's request, whose keys the checkpoint has: vision.param_state_sharding_type = 'dp_reshardable'"
            if writer == "0.17.1" and r["module"] == "vision"
            else ""
        )
        assert r["warnings"] == [
            f"{ckpt} holds the MIMO optimizer state of module(s) {r['module']} in the layout of an unfixed "
            f"Megatron-Core 0.17/0.18 (keys without the 'mimo.<module>.' prefix); read from those keys{assumed}; "
            f"the next save writes the current layout"
        ], (rank, r["warnings"])
