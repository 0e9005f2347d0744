"""Megatron-Core's integrity manifest (``integrity.json``, ``dist_checkpointing.save(verify_integrity=True)``,
0.17.1 and later): checked from metadata by default (listed vs present, load files covered, modified after
the manifest), digests compared only with ``verify_hashes``. Checkpoints saved by this release's own
save with the manifest on, damaged copies of them; every file hashed before and after (nothing written)."""

import hashlib
import inspect as pyinspect
import json
import os

import pytest

from conftest import run_cli
from doctor_fixtures import copy_of, iter_dir  # noqa: F401  (fixtures)
from mcore_ckpt_fixes.doctor import inspect
from mcore_ckpt_fixes.testing.launcher import run_world, values


def codes(r):
    return [p["code"] for p in r.problems]


def _hashes(root):
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (hashlib.sha256(f.read()).hexdigest(), st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def with_manifest(tmp_path_factory):
    from megatron.core import dist_checkpointing

    if "verify_integrity" not in pyinspect.signature(dist_checkpointing.save).parameters:
        pytest.skip("this release's dist_checkpointing.save writes no integrity manifest (added in 0.17.1)")
    root = str(tmp_path_factory.mktemp("integrity") / "ck")
    os.makedirs(root)
    values(run_world("ckpt_makers:save_torch_dist", 2, {"root": root, "integrity": True}, timeout=240))
    return root


def _inspect_unmodified(root, **kw):
    before = _hashes(root)
    r = inspect(root, ep=1, **kw)
    assert _hashes(root) == before  # not a byte, size or mtime changed
    return r


def test_manifest_as_megatron_writes_it(with_manifest):
    ck = iter_dir(with_manifest)
    with open(os.path.join(ck, "integrity.json")) as f:
        manifest = json.load(f)
    # The format of megatron/core/dist_checkpointing/validation.py's save_integrity_manifest.
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted(n for n in os.listdir(ck) if n != "integrity.json")
    r = _inspect_unmodified(with_manifest)
    assert r.ok, r.problems
    assert r["integrity"]["files"] == len(manifest["files"]) and r["integrity"]["hashes"] == "not compared"
    assert r["integrity"]["missing"] == [] and r["integrity"]["unlisted"] == []
    assert "integrity:  integrity.json: " in r.render() and "digests not compared" in r.render()


def test_verify_hashes_opt_in(with_manifest):
    ck = iter_dir(with_manifest)
    md = os.path.getsize(os.path.join(ck, ".metadata"))
    plain = _inspect_unmodified(with_manifest)
    hashed = _inspect_unmodified(with_manifest, verify_hashes=True)
    assert hashed.ok, hashed.problems
    total = sum(os.path.getsize(os.path.join(ck, n)) for n in os.listdir(ck) if n != "integrity.json")
    assert hashed["integrity"]["hashed_bytes"] == total and hashed["integrity"]["differ"] == []
    # The opt-in reads every listed file once more; without it only metadata is read.
    assert hashed.bytes_read == plain.bytes_read + total
    import pickle

    with open(os.path.join(ck, ".metadata"), "rb") as f:  # this test's own trusted file
        index = pickle.load(f)
    objects = sum(info.length for key, info in index.storage_data.items() if key.offset is None)
    small = [os.path.getsize(os.path.join(ck, n)) for n in ("integrity.json", "metadata.json")]
    common = os.path.join(ck, "common.pt")  # up to 0.18: its pickle record is walked
    extra = os.path.getsize(common) if os.path.exists(common) else 0
    # metadata and byte objects only, no tensor payload
    assert md + objects + sum(small) <= plain.bytes_read <= md + objects + sum(small) + extra


def test_listed_file_missing(with_manifest, copy_of):
    root = copy_of(with_manifest)
    ck = iter_dir(root)
    gone = sorted(n for n in os.listdir(ck) if n.endswith(".distcp"))[-1]
    os.remove(os.path.join(ck, gone))
    r = _inspect_unmodified(root)
    assert "integrity-mismatch" in codes(r) and "data-files" in codes(r)
    p = next(p for p in r.problems if p["code"] == "integrity-mismatch")
    assert gone in p["message"] and "--verify-integrity" in p["message"] and p["remedy"]
    assert r["integrity"]["missing"] == [gone]


def test_metadata_json_missing(with_manifest, copy_of):
    root = copy_of(with_manifest)
    os.remove(os.path.join(iter_dir(root), "metadata.json"))
    r = _inspect_unmodified(root)
    assert r["integrity"]["missing"] == ["metadata.json"]
    assert {"integrity-mismatch", "missing-metadata-json"} <= set(codes(r))


def test_size_changed(with_manifest, copy_of):
    """A file grown after the save: a note without hashes (mtime), a problem with them."""
    root = copy_of(with_manifest)
    ck = iter_dir(root)
    grown = sorted(n for n in os.listdir(ck) if n.endswith(".distcp"))[0]
    with open(os.path.join(ck, grown), "ab") as f:
        f.write(b"\0" * 16)
    r = _inspect_unmodified(root)
    assert r.ok and r["integrity"]["modified_after_manifest"] == [grown]
    assert any(grown in n and "modified after integrity.json" in n for n in r.notes)
    r = _inspect_unmodified(root, verify_hashes=True)
    assert codes(r) == ["integrity-mismatch"] and r["integrity"]["differ"] == [grown]
    assert grown in r.problems[0]["message"] and r.problems[0]["remedy"]


def test_file_cut(with_manifest, copy_of):
    root = copy_of(with_manifest)
    ck = iter_dir(root)
    cut = sorted(n for n in os.listdir(ck) if n.endswith(".distcp"))[0]
    with open(os.path.join(ck, cut), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(ck, cut)) - 8)
    r = _inspect_unmodified(root, verify_hashes=True)
    assert "data-files" in codes(r) and "integrity-mismatch" in codes(r)


def test_unlisted_and_bad_manifest(with_manifest, copy_of):
    root = copy_of(with_manifest)
    ck = iter_dir(root)
    with open(os.path.join(ck, "__9_0.distcp"), "wb") as f:
        f.write(b"x")
    with open(os.path.join(ck, "README"), "w") as f:
        f.write("mine")
    r = _inspect_unmodified(root)
    assert codes(r) == ["integrity-unlisted"] and r["integrity"]["unlisted"] == ["__9_0.distcp"]
    path = os.path.join(ck, "integrity.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["algorithm"] = "md5"
    with open(path, "w") as f:
        json.dump(manifest, f)
    r = _inspect_unmodified(root)
    # The rejected algorithm is named by the integrity-mismatch problem itself.
    assert any(p["code"] == "integrity-mismatch" and "'md5'" in p["message"] for p in r.problems), r.problems
    with open(path, "w") as f:
        f.write('{"algorithm": "sha256", "fi')
    r = _inspect_unmodified(root)
    assert any(p["code"] == "integrity-mismatch" and "not valid JSON" in p["message"] for p in r.problems)


def test_cli_exit_codes(with_manifest, copy_of):
    proc = run_cli(["inspect", with_manifest, "--ep", "1", "--json"])
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout)["integrity"]["files"] >= 3
    root = copy_of(with_manifest)
    os.remove(os.path.join(iter_dir(root), sorted(n for n in os.listdir(iter_dir(root)) if n.endswith(".distcp"))[0]))
    proc = run_cli(["inspect", root, "--ep", "1"])
    assert proc.returncode == 1 and "[integrity-mismatch]" in proc.stdout and "next: " in proc.stdout


def test_cli_verify_hashes_flag(with_manifest, copy_of):
    """``--verify-hashes``: a file changed after the save is a note (exit 0) from metadata alone, a
    problem (exit 1) once the digests are compared; the checkpoint is not modified either way."""
    root = copy_of(with_manifest)
    ck = iter_dir(root)
    grown = sorted(n for n in os.listdir(ck) if n.endswith(".distcp"))[0]
    with open(os.path.join(ck, grown), "ab") as f:
        f.write(b"\0" * 16)
    before = _hashes(root)
    plain = run_cli(["inspect", root, "--ep", "1"])
    hashed = run_cli(["inspect", root, "--ep", "1", "--verify-hashes"])
    assert _hashes(root) == before
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert hashed.returncode == 1 and "[integrity-mismatch]" in hashed.stdout and grown in hashed.stdout, hashed.stdout
