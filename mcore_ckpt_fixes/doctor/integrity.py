"""Megatron-Core's integrity manifest (``integrity.json``), checked from metadata by default.

``dist_checkpointing.save(..., verify_integrity=True)`` (Megatron-LM: ``--verify-integrity``,
``CheckpointConfig.verify_integrity``; torch_dist only; in the wheels from 0.17.1 and 0.18.0 on,
0.19.x included) has rank 0, after every file and ``metadata.json`` are written, hash each regular
file of the checkpoint directory and write::

    {"algorithm": "sha256", "files": {"<file name>": "<sha256 hex digest>", ...}}

(``megatron/core/dist_checkpointing/validation.py``: ``INTEGRITY_FNAME``, ``save_integrity_manifest``).
``load(..., verify_integrity=True)`` re-hashes every listed file and raises ``CheckpointingException``
on a missing file, a digest that differs, or another algorithm; files not listed are ignored.

The manifest records names and digests only, no sizes. What the doctor checks without reading a
payload byte: the manifest is readable and well formed, every listed file is present (a regular
file), every file a load reads (``.metadata``, ``*.distcp``, ``metadata.json``, ``common.pt``) is
listed, and which files changed after the manifest was written (mtime; a note, since copies reorder
mtimes). Comparing the digests means reading every byte of every file, tensor payloads included: the
doctor does that only when asked (``inspect(..., verify_hashes=True)``), and says so in the report
otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Dict, List, Optional

MANIFEST = "integrity.json"
ALGORITHM = "sha256"  # the only one Megatron-Core writes and accepts
MAX_MANIFEST_BYTES = 64 << 20  # ~ 100 bytes a file: far more files than any checkpoint directory holds
_READ = 1 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
# The files a torch_dist / DCP load opens: not listed means not covered by the manifest.
_LOAD_READS = re.compile(r"^(?:\.metadata|metadata\.json|common\.pt|.*\.distcp)$")
VERIFY_HINT = "digests not compared (that reads every byte: inspect with verify_hashes=True / --verify-hashes)"


def _mismatch(report, message: str, **extra) -> dict:
    return report.problem("integrity-mismatch", message, file=MANIFEST, **extra)


def _sha256(path: str, report) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ)
            if not block:
                break
            report.bytes_read += len(block)
            h.update(block)
    return h.hexdigest()


def check(report, ckdir: str, names: List[str], verify_hashes: bool = False) -> None:
    """Check ``ckdir/integrity.json`` when it is there (``names``: the directory listing)."""
    if MANIFEST not in names:
        return
    path = os.path.join(ckdir, MANIFEST)
    info: Dict[str, object] = {"file": MANIFEST}
    report["integrity"] = info
    manifest = _read(report, path)
    if manifest is None:
        info["summary"] = "unreadable"
        return
    algorithm, listed = manifest
    info.update(algorithm=algorithm, files=len(listed))
    try:
        manifest_mtime = os.stat(path).st_mtime_ns
    except OSError:
        manifest_mtime = None

    missing, not_files, newer = [], [], []
    for name in sorted(listed):
        try:
            st = os.stat(os.path.join(ckdir, name))
        except OSError:
            missing.append(name)
            continue
        if not os.path.isfile(os.path.join(ckdir, name)):
            not_files.append(name)
        elif manifest_mtime is not None and st.st_mtime_ns > manifest_mtime:
            newer.append(name)
    for name in missing:
        _mismatch(
            report,
            f"{name} is listed in {MANIFEST} but missing: a load with --verify-integrity "
            "fails ('file missing or unreadable'); one without it loads without that file's data",
        )
    for name in not_files:
        _mismatch(report, f"{name} is listed in {MANIFEST} as a file but is not a regular file")
    unlisted = [
        n
        for n in names
        if n != MANIFEST and n not in listed and _LOAD_READS.match(n) and os.path.isfile(os.path.join(ckdir, n))
    ]
    for name in unlisted:
        report.problem(
            "integrity-unlisted",
            f"{name} is read by a load but not listed in {MANIFEST}: it was added or renamed after the "
            "save wrote the manifest, so --verify-integrity does not cover it",
            file=name,
        )
    if newer:
        shown = ", ".join(newer[:5]) + (f", ... ({len(newer)} in all)" if len(newer) > 5 else "")
        report.note(
            f"{shown} modified after {MANIFEST} was written (mtime; a copy that did not keep mtimes "
            f"shows this too){'' if verify_hashes else ': compare the digests to tell (--verify-hashes)'}"
        )
    info["missing"], info["unlisted"], info["modified_after_manifest"] = missing, unlisted, newer

    if not verify_hashes:
        info["hashes"] = "not compared"
        info["summary"] = (
            f"{len(listed)} files listed ({algorithm}), {len(listed) - len(missing)} present; " + VERIFY_HINT
        )
        return
    _compare_digests(report, info, ckdir, algorithm, listed, skip=set(missing) | set(not_files))


def _compare_digests(report, info, ckdir: str, algorithm: str, listed: dict, skip: set) -> None:
    """--verify-hashes: every listed file present (not in ``skip``) hashed and compared."""
    differ, hashed = [], 0
    before = report.bytes_read
    for name in sorted(listed):
        if name in skip:
            continue
        want = listed[name]
        try:
            got = _sha256(os.path.join(ckdir, name), report)
        except OSError as exc:
            _mismatch(report, f"{name} cannot be read to hash it: {exc.strerror or exc}")
            continue
        hashed += 1
        if got != want:
            differ.append(name)
            _mismatch(
                report,
                f"{name}: {ALGORITHM} {got[:16]}... differs from {MANIFEST}'s {want[:16]}...: the file "
                "changed after the save; a load with --verify-integrity refuses this checkpoint, one "
                "without it reads the changed bytes",
                sha256=got,
                expected=want,
            )
    info["hashes"] = "compared"
    info["hashed_files"], info["hashed_bytes"], info["differ"] = hashed, report.bytes_read - before, differ
    info["summary"] = f"{len(listed)} files listed ({algorithm}), {hashed} hashed: " + (
        f"{len(differ)} differ" if differ else "all digests match"
    )


def _read(report, path: str) -> Optional[tuple]:
    """(algorithm, {name: digest}) or None after recording why it cannot be used."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        _mismatch(report, f"{MANIFEST} cannot be read: {exc.strerror or exc}; a load with --verify-integrity fails")
        return None
    report.bytes_read += len(raw)
    if len(raw) > MAX_MANIFEST_BYTES:
        _mismatch(report, f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes: not a manifest Megatron wrote")
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        _mismatch(report, f"{MANIFEST} is not valid JSON ({exc}): cut or damaged; a load with --verify-integrity fails")
        return None
    files = data.get("files") if isinstance(data, dict) else None
    algorithm = data.get("algorithm", ALGORITHM) if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        _mismatch(
            report,
            f"{MANIFEST} has no 'files' object of name -> digest: not the manifest Megatron writes; "
            "a load with --verify-integrity fails",
        )
        return None
    if algorithm != ALGORITHM:
        _mismatch(
            report,
            f"{MANIFEST} uses algorithm {algorithm!r}; Megatron-Core accepts only {ALGORITHM!r} "
            "(a load with --verify-integrity raises)",
        )
        return None
    bad = [k for k, v in files.items() if not _HEX.match(v) or os.sep in k or k in ("", ".", "..")]
    if bad:
        _mismatch(
            report,
            f"{MANIFEST}: {len(bad)} entries are not a file name with a {ALGORITHM} hex digest (first: {bad[0]!r})",
        )
        files = {k: v for k, v in files.items() if k not in bad}
    return algorithm, files
