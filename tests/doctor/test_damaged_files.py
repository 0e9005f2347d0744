"""Every file a load would open, checked for presence, readability and a whole container without
reading a tensor payload: each damaged file is one problem naming it (exit 1). Damaged copies of
checkpoints the real save paths wrote; every file hashed before and after (the doctor writes nothing)."""

import builtins
import os
import pickle
import struct
import subprocess
import sys
import zipfile

import pytest

from ckpt_makers import save_legacy
from conftest import run_cli
from doctor_fixtures import copy_of, iter_dir, saved  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import inspect
from test_cli import tree_state


def codes(r):
    return [p["code"] for p in r.problems]


def _cut(path, how):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate({"empty": 0, "300 bytes": 300, "half": size // 2}[how])


@pytest.fixture(scope="module")
def legacy_root(tmp_path_factory):
    return os.path.dirname(save_legacy(str(tmp_path_factory.mktemp("leg") / "ck"), 2, 1, 1))


@pytest.mark.parametrize("rank", ["mp_rank_00", "mp_rank_01"])
@pytest.mark.parametrize("how", ["empty", "300 bytes", "half"])
def test_legacy_rank_file_cut(legacy_root, tmp_path, rank, how):
    import shutil

    root = str(tmp_path / "ck")
    shutil.copytree(legacy_root, root)
    rel = f"{rank}/model_optim_rng.pt"
    _cut(os.path.join(iter_dir(root), rel), how)
    before = tree_state(root)
    r = inspect(root)
    assert codes(r) == ["damaged-file"] and r.problems[0]["file"] == rel, r.problems
    msg = r.problems[0]["message"]
    assert msg.startswith(f"{rel}: ") and ("empty (0 bytes)" in msg if how == "empty" else "cut short" in msg), msg
    proc = run_cli(["inspect", root])
    assert proc.returncode == 1 and f"[damaged-file] {rel}: " in proc.stdout, proc.stdout + proc.stderr
    assert tree_state(root) == before


def test_legacy_old_format_stream_cut(tmp_path):
    import torch

    it = save_legacy(str(tmp_path / "ck"), 1, 1, 1, weight_numel=4096)
    path = os.path.join(it, "mp_rank_00", "model_optim_rng.pt")
    sd = torch.load(path, weights_only=False)  # the test's own trusted file
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert inspect(it).ok
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # inside the last storage's bytes
    r = inspect(it)
    assert codes(r) == ["damaged-file"] and "old torch.save stream cut short" in r.problems[0]["message"], r.problems


def test_zip_member_larger_than_the_archive(tmp_path):
    """The central directory claims more bytes for a tensor storage than lie before the next record."""
    it = save_legacy(str(tmp_path / "ck"), 1, 1, 1, weight_numel=1024)
    path = os.path.join(it, "mp_rank_00", "model_optim_rng.pt")
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if "/data/" in n)
    data = bytearray(open(path, "rb").read())
    entry = data.index(b"PK\x01\x02")  # the first central directory entry
    while True:  # find the central entry of ``name``
        n_len = struct.unpack_from("<H", data, entry + 28)[0]
        if bytes(data[entry + 46 : entry + 46 + n_len]).decode() == name:
            break
        entry = data.index(b"PK\x01\x02", entry + 4)
    size = struct.unpack_from("<I", data, entry + 20)[0]
    struct.pack_into("<II", data, entry + 20, size * 4, size * 4)  # compressed and uncompressed sizes
    with open(path, "wb") as f:
        f.write(data)
    r = inspect(it)
    assert codes(r) == ["damaged-file"], r.problems
    assert f"member {name} claims {size * 4} bytes" in r.problems[0]["message"]


def test_empty_common_pt(saved, copy_of):
    """0.16-0.18 require common.pt, 0.19 reads it when present: an empty one fails every load (EOFError)."""
    root = copy_of(saved["torch_dist"])
    open(os.path.join(iter_dir(root), "common.pt"), "wb").close()
    before = tree_state(root)
    r = inspect(root, ep=1)
    assert codes(r) == ["damaged-file"] and r.problems[0]["file"] == "common.pt", r.problems
    assert "empty (0 bytes): torch.load fails with EOFError" in r.problems[0]["message"]
    assert r["readable_by"] == []
    proc = run_cli(["inspect", root, "--ep", "1"])
    assert proc.returncode == 1 and "[damaged-file] common.pt: empty (0 bytes)" in proc.stdout
    assert tree_state(root) == before


def test_distcp_that_cannot_be_opened(saved, copy_of, monkeypatch):
    root = copy_of(saved["torch_dist"])
    ck = iter_dir(root)
    target = os.path.join(ck, "__1_0.distcp")
    real_open = builtins.open

    def denying_open(path, *args, **kwargs):
        if os.fspath(path) == target:
            raise PermissionError(13, "Permission denied", target)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denying_open)
    r = inspect(root, ep=1)
    monkeypatch.undo()
    assert codes(r) == ["unreadable-file"] and r.problems[0]["file"] == "__1_0.distcp", r.problems
    assert "__1_0.distcp cannot be opened: Permission denied" in r.problems[0]["message"]
    assert r["readable_by"] == []


def test_distcp_replaced_by_a_directory(saved, copy_of):
    """What a user (root included) cannot open either way: the CLI's exit code and line."""
    root = copy_of(saved["torch_dist"])
    target = os.path.join(iter_dir(root), "__1_0.distcp")
    os.remove(target)
    os.makedirs(target)
    proc = run_cli(["inspect", root, "--ep", "1"])
    assert proc.returncode == 1 and "[unreadable-file] __1_0.distcp cannot be opened" in proc.stdout, proc.stdout


# Linux capabilities that let root read any file whatever its mode (linux/capability.h), and the
# prctl that removes one from a process's bounding set (linux/prctl.h).
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


def _without_read_override():
    """For a child of root: drop the capabilities that override file modes from the bounding set
    before exec, so the new interpreter (still uid 0, still owner of the checkpoint's files and of
    the interpreter's own) is refused a mode-0 file by the kernel, as any user is."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")


def _unprivileged_preexec():
    """How to start the CLI so that file modes bind it: as it is for a user; for root, a child
    without the read-override capabilities; None where this platform cannot do that."""
    if os.geteuid() != 0:
        return lambda: None
    if not sys.platform.startswith("linux"):
        return None
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_without_read_override, check=True)
    except subprocess.SubprocessError:  # no CAP_SETPCAP (a restricted container): the drop is refused
        return None
    return _without_read_override


def test_distcp_without_read_permission(saved, copy_of):
    """A shard file whose mode forbids reading it, inspected by a process that file modes bind."""
    preexec = _unprivileged_preexec()
    if preexec is None:
        pytest.skip("root here cannot give up reading files whatever their mode (no prctl capability drop)")
    root = copy_of(saved["torch_dist"])
    target = os.path.join(iter_dir(root), "__1_0.distcp")
    os.chmod(target, 0)
    proc = run_cli(["inspect", root, "--ep", "1"], preexec_fn=preexec)
    assert (
        proc.returncode == 1 and "[unreadable-file] __1_0.distcp cannot be opened: Permission denied" in proc.stdout
    ), proc.stdout + proc.stderr
    # The only problem: every other file of the checkpoint was read as usual.
    assert proc.stdout.count("[unreadable-file]") == 1 and "[damaged-file]" not in proc.stdout, proc.stdout


def test_damaged_byte_object(saved, copy_of):
    """The RNG byte object pointed at bytes that are no torch.save container."""
    root = copy_of(saved["torch_dist"])
    ck = iter_dir(root)
    with open(os.path.join(ck, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own trusted file
    key = next(k for k in md.storage_data if k.fqn.startswith("rng_state"))
    info = md.storage_data[key]
    with open(os.path.join(ck, info.relative_path), "ab") as f:
        offset = f.tell()
        f.write(b"PK\x03\x04" + b"\0" * 60)
    md.storage_data[key] = type(info)(relative_path=info.relative_path, offset=offset, length=64)
    with open(os.path.join(ck, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    r = inspect(root, ep=1)
    assert codes(r) == ["damaged-file"], r.problems
    assert r.problems[0]["file"] == f"{info.relative_path} (byte object {key.fqn})"
