"""A pickle that would run a callable outside the allow-list is a problem (exit 1) naming the file and
the callable, in every file a load would unpickle: legacy rank files (zip or raw pickle), common.pt,
DCP's .metadata and the byte objects inside .distcp files. Nothing is ever run (a marker file tells)."""

import io
import os
import pickle
import zipfile

from ckpt_makers import save_legacy
from conftest import run_cli
from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import inspect


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def unsafe(r):
    return [p for p in r.problems if p["code"] == "unsafe-pickle"]


def _replace_zip_record(path, obj):
    """Rewrite the data.pkl record of the torch.save zip at ``path`` with ``obj`` pickled."""
    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = pickle.dumps(obj, protocol=2)
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in entries.items():
            zf.writestr(n, data)


def test_legacy_rank_file_other_than_rank_0(tmp_path):
    """Rank 1's file is never the args source: it is still unpickled by rank 1's load, so it is checked."""
    marker = tmp_path / "pwned"
    it = save_legacy(str(tmp_path / "ck"), 2, 1, 1)
    _replace_zip_record(os.path.join(it, "mp_rank_01", "model_optim_rng.pt"), {"args": Evil(marker)})
    r = inspect(it)
    assert [(p["file"], p["callable"]) for p in unsafe(r)] == [("mp_rank_01/model_optim_rng.pt", "posix.system")]
    assert "mp_rank_01/model_optim_rng.pt: its pickle calls posix.system" in r.problems[0]["message"]
    assert r["saved_args"]["tp"] == 2 and not marker.exists()


def test_legacy_raw_pickle(tmp_path):
    """A raw pickle: torch.load unpickles its first object before it checks the magic number."""
    marker = tmp_path / "pwned"
    it = save_legacy(str(tmp_path / "ck"), 1, 1, 1)
    with open(os.path.join(it, "mp_rank_00", "model_optim_rng.pt"), "wb") as f:
        pickle.dump({"args": Evil(marker), "iteration": 100}, f, protocol=2)
    proc = run_cli(["inspect", os.path.dirname(it)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[unsafe-pickle] mp_rank_00/model_optim_rng.pt: its pickle calls posix.system" in proc.stdout
    assert not marker.exists()


def test_legacy_old_torch_save_format_is_walked(tmp_path):
    """The non-zip torch.save stream: clean when whole; an unsafe object inside is found."""
    import torch

    marker = tmp_path / "pwned"
    it = save_legacy(str(tmp_path / "ck"), 1, 1, 1)
    path = os.path.join(it, "mp_rank_00", "model_optim_rng.pt")
    sd = torch.load(path, weights_only=False)  # the test's own trusted file
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    r = inspect(it)
    assert r.ok and r["saved_args"]["tp"] == 1, r.problems
    sd["model"]["extra"] = Evil(marker)
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    r = inspect(it)
    assert [(p["file"], p["callable"]) for p in unsafe(r)] == [("mp_rank_00/model_optim_rng.pt", "posix.system")]
    assert not marker.exists()


def test_common_pt(saved, copy_of, tmp_path):
    """common.pt (written up to 0.18; still read by 0.19 when present) with a planted callable."""
    import torch

    marker = tmp_path / "pwned"
    root = copy_of(saved["torch_dist"])
    torch.save({"args": Evil(marker), "iteration": 10}, os.path.join(iter_dir(root), "common.pt"))
    proc = run_cli(["inspect", root])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[unsafe-pickle] common.pt: its pickle calls posix.system" in proc.stdout
    assert not marker.exists()


def test_dcp_byte_object(saved, copy_of, tmp_path):
    """The RNG byte object DCP hands to torch.load(weights_only=False), pointed at planted bytes."""
    import torch

    marker = tmp_path / "pwned"
    root = copy_of(saved["torch_dist"])
    ck = iter_dir(root)
    buf = io.BytesIO()
    torch.save([{"random_rng_state": Evil(marker)}], buf)
    with open(os.path.join(ck, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own trusted file
    key = next(k for k in md.storage_data if k.fqn.startswith("rng_state"))
    info = md.storage_data[key]
    path = os.path.join(ck, info.relative_path)
    with open(path, "ab") as f:
        offset = f.tell()
        f.write(buf.getvalue())
    md.storage_data[key] = type(info)(relative_path=info.relative_path, offset=offset, length=len(buf.getvalue()))
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    r = inspect(root)
    assert [p["callable"] for p in unsafe(r)] == ["posix.system"], r.problems
    assert unsafe(r)[0]["file"] == f"{info.relative_path} (byte object {key.fqn})"
    assert not marker.exists()


def test_dcp_metadata(saved, copy_of, tmp_path):
    """.metadata itself: DCP reads it with pickle.load. A problem (exit 1), not 'unreadable' (exit 2)."""
    marker = tmp_path / "pwned"
    root = copy_of(saved["torch_dist"])
    with open(os.path.join(iter_dir(root), ".metadata"), "wb") as f:
        pickle.dump(Evil(marker), f)
    proc = run_cli(["inspect", root, "--json"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "posix.system" in proc.stdout and '"code": "unsafe-pickle"' in proc.stdout
    assert not marker.exists()
