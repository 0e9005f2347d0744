"""Distributed checkpoints: ``torch_dist`` (Megatron's dist_checkpointing) and plain torch DCP
(``fsdp_dtensor`` / ``torch_dcp``), from their metadata only.

Files read: ``metadata.json`` (torch_dist's marker: backend and version), ``.metadata`` (DCP's
pickled index of every tensor's chunks and every byte object, read as a stream of opcodes by
dcp_scan, or through safe_pickle where that reader cannot tell), the pickle
record of ``common.pt`` and the byte objects inside the ``.distcp`` files (small pickles a load
unpickles: walked with the allow-list, see files), and the names and sizes of the other files
(``os.stat``). No tensor payload is read.

Which Megatron-Core releases read a torch_dist checkpoint depends on where its common (non-sharded)
state is: up to 0.18 ``dist_checkpointing.save`` writes it to ``common.pt`` and ``load`` requires
that file ("Common file ... does not exist"); 0.19 embeds it as the ShardedObject ``common_state``
inside the DCP files and still reads ``common.pt`` when present. So a checkpoint with common.pt is
readable by 0.16-0.19, one with only the embedded state by 0.19 alone. Both need ``metadata.json``:
without it ``check_is_distributed_checkpoint`` is false and no release loads it as torch_dist.
Plain DCP checkpoints are read by ``megatron.training``'s torch_dcp / fsdp_dtensor path, present
in every release line tested (0.16-0.19).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

from . import coverage, dcp_objects, dcp_scan, experts, files, safe_pickle, sizes
from .report import Unreadable

RELEASES = ("0.16", "0.17", "0.18", "0.19")
EMBEDDED_COMMON_SINCE = "0.19"
CONFIG = "metadata.json"
DCP_METADATA = ".metadata"
COMMON = "common.pt"
COMMON_KEY = "common_state/shard_0_1"
_SHARDED_OBJECT = re.compile(r"^(?P<key>.+)/shard_(?P<off>[\d.]+)_(?P<shape>[\d.]+)$")
_FSDP_RNG = re.compile(r"(?:^|\.)rng_state\.\((?P<idx>\d+(?:, ?\d+)*)\)")
MAX_LISTED = 20  # problems listed per code; the count says how many in all


def is_distributed(names: List[str]) -> bool:
    return CONFIG in names or DCP_METADATA in names or any(n.endswith(".distcp") for n in names)


def read_metadata(path: str, report) -> "dcp_scan.Index":
    """DCP's index (shapes, chunk boxes, data-file extents, byte-object ranges), read as a stream of
    pickle opcodes (dcp_scan) or, for a spelling that reader does not know, with the allow-list
    unpickler; raises Unreadable or safe_pickle.UnsafeGlobal."""
    try:
        f = open(path, "rb", buffering=1 << 20)
    except OSError as exc:
        raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        read = 0
        try:
            try:
                return dcp_scan.read(f)
            except OSError:
                raise
            except Exception:  # Fallback, or a cut or odd file: the allow-list unpickler decides and says why
                pass
            read += f.tell()
            f.seek(0)
            # Unpickled from the file, not from its bytes in memory: 135 MB less peak memory at 1M chunks.
            md = safe_pickle.load(f)
        except safe_pickle.UnsafeGlobal:
            raise
        except OSError as exc:
            raise Unreadable(f"cannot read {path}: {exc.strerror or exc}") from None
        except Exception as exc:  # truncated/corrupt pickles raise EOFError, UnpicklingError, ValueError, ...
            raise Unreadable(
                f"cannot read {path} ({size} bytes): truncated or corrupt ({type(exc).__name__}: {exc}); "
                "the save did not finish or the file was cut"
            ) from None
        finally:
            report.bytes_read += read + f.tell()
    if not hasattr(md, "state_dict_metadata") or not isinstance(getattr(md, "state_dict_metadata"), dict):
        raise Unreadable(f"{path} is not torch.distributed.checkpoint metadata (no state_dict_metadata)")
    return index_from_unpickled(md)


def index_from_unpickled(md) -> "dcp_scan.Index":
    """The Index of metadata read by the allow-list unpickler (stand-in objects)."""
    sdm = {}
    for fqn, meta in md.state_dict_metadata.items():
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            sdm[fqn] = dcp_scan.BytesMeta()
        else:
            sdm[fqn] = dcp_scan.TensorMeta(
                getattr(meta, "size", ()), [(getattr(c, "offsets", ()), getattr(c, "sizes", ())) for c in chunks]
            )
    ends, objects = dcp_objects.object_ranges(getattr(md, "storage_data", None) or {})
    return dcp_scan.Index(sdm, ends, objects)


def _read_config(path: str, report) -> Tuple[Optional[dict], Optional[str]]:
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 16)
        report.bytes_read += len(raw)
        cfg = json.loads(raw.decode("utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
        return cfg, None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return None, f"{CONFIG} is unreadable ({exc}): Megatron cannot open this checkpoint"


def _listed(report, code: str, items: List[str], head: str) -> List[dict]:
    out = []
    for msg in items[:MAX_LISTED]:
        out.append(report.problem(code, msg))
    if len(items) > MAX_LISTED:
        out.append(report.problem(code, f"{head}: {len(items) - MAX_LISTED} more not listed ({len(items)} in all)"))
    return out


class Verdict:
    """Which releases can read the checkpoint, and why; narrowed as findings come in."""

    def __init__(self):
        self.readable, self.reason = list(RELEASES), ""

    def none(self, reason: str) -> None:
        self.readable, self.reason = [], reason


def analyze(report, ckdir: str, names: List[str], run: dict) -> None:
    has_cfg, has_md = CONFIG in names, DCP_METADATA in names
    has_common = COMMON in names
    cfg, cfg_err = _read_config(os.path.join(ckdir, CONFIG), report) if has_cfg else (None, None)
    if cfg_err:
        report.problem("metadata-json-unreadable", cfg_err)
    if not has_md:
        _incomplete(report, names, has_cfg, has_common)
        return
    try:
        md = read_metadata(os.path.join(ckdir, DCP_METADATA), report)
    except safe_pickle.UnsafeGlobal as exc:
        report["format"] = "torch_dist" if (has_cfg or has_common) else "unknown"
        files.unsafe_pickle(report, DCP_METADATA, exc, "DCP's load unpickles it with pickle.load")
        report["readable_by"], report["readable_by_reason"] = [], "unsafe pickle in .metadata"
        return
    sdm: Dict[str, object] = md.state_dict_metadata
    keys = list(sdm)
    verdict = Verdict()
    _format(report, cfg, has_cfg, has_common, sdm, keys, verdict)
    _coverage(report, sdm, verdict)
    objects = _data_files(report, ckdir, md, verdict)
    common = None
    if has_common:
        common, err = files.read_torch_file(report, ckdir, COMMON)
        if err is not None:
            verdict.none("common.pt damaged, unreadable or unsafe: every release that finds it reads it")
    run = sizes.resolve(report, run, *_saved_args(common, objects))
    _experts(report, sdm, keys)
    _rng(report, keys, run)
    _common_state(report, sdm, has_common, verdict)
    report["readable_by"], report["readable_by_reason"] = verdict.readable, verdict.reason


def _saved_args(common, objects: Dict[str, object]):
    """(the args the checkpoint saved, where): common.pt (up to 0.18), the embedded common state (0.19),
    or a plain ``args`` byte object (torch_dcp / fsdp_dtensor)."""
    for where, record in (
        (COMMON, common),
        ("the embedded common state", objects.get(COMMON_KEY)),
        ("the args byte object", {"args": objects.get("args")}),
    ):
        if isinstance(record, list) and len(record) == 1:  # a ShardedObject's data as torch_dist stores it
            record = record[0]
        args = record.get("args") if isinstance(record, dict) else None
        if args is not None:
            return args, where
    return None, None


def _incomplete(report, names: List[str], has_cfg: bool, has_common: bool) -> None:
    distcp = [n for n in names if n.endswith(".distcp")]
    report["format"] = "torch_dist" if (has_cfg or has_common) else "unknown"
    report["format_reason"] = "incomplete save"
    report.problem(
        "incomplete-save",
        f"{len(distcp)} .distcp files but no .metadata"
        + ("" if has_cfg else f" and no {CONFIG}")
        + ": the save did not finish (.metadata is written after every rank's data); nothing can load this",
    )
    report["readable_by"], report["readable_by_reason"] = [], "incomplete save"


def _format(report, cfg, has_cfg: bool, has_common: bool, sdm, keys: List[str], verdict: Verdict) -> None:
    """torch_dist (by metadata.json, or by its files when that is missing), fsdp_dtensor or torch_dcp."""
    looks_torch_dist = has_common or COMMON_KEY in sdm or any("/shard_" in k for k in keys)
    if has_cfg and cfg is not None:
        backend = cfg.get("sharded_backend")
        report["format"] = "torch_dist" if backend == "torch_dist" else "unknown"
        report["format_reason"] = f"{CONFIG}: sharded_backend={backend!r}, version {cfg.get('sharded_backend_version')}"
        if backend != "torch_dist":
            report.problem(
                "unsupported-backend", f"sharded_backend {backend!r}: releases 0.16-0.19 load torch_dist only"
            )
            verdict.none(f"backend {backend!r}")
    elif has_cfg:
        report["format"] = "torch_dist"
        report["format_reason"] = f"{CONFIG} present but unreadable"
        verdict.none(f"{CONFIG} unreadable")
    elif looks_torch_dist:
        report["format"] = "torch_dist"
        report["format_reason"] = (
            f"DCP files with dist_checkpointing's "
            f"{'common.pt' if has_common else 'ShardedObject keys'}, but no {CONFIG}"
        )
        report.problem(
            "missing-metadata-json",
            f"no {CONFIG}: Megatron does not take this directory for a distributed checkpoint "
            f"(check_is_distributed_checkpoint is false) and fails to load it; {CONFIG} is written last, "
            "so the save did not finish, or the file was removed",
        )
        verdict.none(f"no {CONFIG}")
    else:
        fsdp = any(_FSDP_RNG.search(k) for k in keys) or any(
            experts.GROUPED_KEY.match(k) for k in keys if ".experts." in k
        )
        report["format"] = "fsdp_dtensor" if fsdp else "torch_dcp"
        report["format_reason"] = (
            "plain torch DCP (.metadata, no metadata.json) with Megatron-FSDP's keys (rng_state.(pp, tp) or "
            "experts' weight{i})"
            if fsdp
            else "plain torch DCP (.metadata, no metadata.json)"
        )


def _coverage(report, sdm, verdict: Verdict) -> None:
    """Every tensor covered exactly by its chunks."""
    n_tensors = n_chunks = n_objects = 0
    cov: List[str] = []
    for fqn, meta in sdm.items():
        chunks = getattr(meta, "chunks", None)
        if chunks is None:
            n_objects += 1
            continue
        n_tensors += 1
        n_chunks += len(chunks)
        findings = coverage.check(meta.size, chunks)
        for kind, detail in findings[: coverage.MAX_FINDINGS]:
            cov.append(f"{fqn} (shape {list(meta.size)}, {len(chunks)} chunks): {kind}: {detail}")
        if len(findings) > coverage.MAX_FINDINGS:
            cov.append(f"{fqn}: more {kind}s not listed")
    report["tensors"], report["chunks"], report["objects"] = n_tensors, n_chunks, n_objects
    report["coverage_problems"] = _listed(report, "chunk-coverage", cov, "chunk coverage")
    if cov:
        verdict.none("chunks do not cover every tensor exactly: loads fail or read the wrong values")


def _data_files(report, ckdir: str, md, verdict: Verdict) -> Dict[str, object]:
    """Data files named by the index: present and long enough (stat only); then the byte objects in
    them, walked (see dcp_objects). Returns the byte objects read."""
    ends, objects = md.ends, md.objects
    bad_files, bad_names, unopenable = [], set(), set()
    for rel, end in sorted(ends.items()):
        try:
            st = os.stat(os.path.join(ckdir, rel))
        except OSError:
            bad_files.append(f"{rel} is named by .metadata but missing")
            bad_names.add(rel)
            continue
        if not files.check_openable(report, ckdir, rel):  # permissions, or not a file at all
            unopenable.add(rel)
        elif st.st_size < end:
            bad_files.append(f"{rel} is {st.st_size} bytes, .metadata needs {end}: truncated")
            bad_names.add(rel)
    _listed(report, "data-files", bad_files, "data files")
    if bad_files or unopenable:
        verdict.none("data files missing, truncated or unreadable")
    n_problems = len(report.problems)
    read = dcp_objects.read_objects(report, ckdir, objects, skip=bad_names.union(unopenable))
    if len(report.problems) > n_problems:
        verdict.none("byte objects damaged or unsafe")
    return read


def _experts(report, sdm, keys: List[str]) -> None:
    summary, found = experts.check(keys)
    n_single, single_found = experts.check_single_grouped(
        {k: list(meta.size) for k, meta in sdm.items() if getattr(meta, "chunks", None) is not None}
    )
    found += single_found
    if n_single:
        summary = (
            summary + "; " if summary else ""
        ) + f"{n_single} single grouped expert tensor{'' if n_single == 1 else 's'}"
    if summary:
        report["experts"] = summary
    report["expert_problems"] = []
    for code, msg in found:
        report["expert_problems"].append(report.problem(code, msg))


def _common_state(report, sdm, has_common: bool, verdict: Verdict) -> None:
    """Where the common state is (common.pt up to 0.18, embedded from 0.19) and who can read it."""
    if report["format"] != "torch_dist":
        if verdict.readable and not verdict.reason:
            verdict.reason = "plain torch DCP: loaded by megatron.training's torch_dcp/fsdp_dtensor path"
        return
    embedded = COMMON_KEY in sdm
    if has_common:
        report["common_state"] = "common.pt (written by 0.16-0.18" + ("; also embedded)" if embedded else ")")
    elif embedded:
        report["common_state"] = "embedded (ShardedObject common_state, written by 0.19)"
        if verdict.readable:
            verdict.readable = [r for r in verdict.readable if r >= EMBEDDED_COMMON_SINCE]
            verdict.reason = "common state embedded (no common.pt): releases before 0.19 require common.pt"
    else:
        report["common_state"] = "missing"
        report.problem(
            "common-state-missing",
            "neither common.pt nor an embedded common_state: the args, iteration and every "
            "non-tensor state are gone; no release can load this",
        )
        verdict.none("no common state")
    if verdict.readable and not verdict.reason:
        verdict.reason = "common.pt present: 0.16-0.18 read it, 0.19 reads it as the legacy common state"


def _rng(report, keys: List[str], run: dict) -> None:
    shapes, offsets = set(), []
    for k in keys:
        m = _SHARDED_OBJECT.match(k)
        if m and m.group("key").endswith("rng_state"):
            shape = tuple(int(x) for x in m.group("shape").split("."))
            shapes.add(shape)
            offsets.append(tuple(int(x) for x in m.group("off").split(".")))
            continue
        m = _FSDP_RNG.search(k)
        if m:
            idx = tuple(int(x) for x in m.group("idx").replace(" ", "").split(","))
            offsets.append(idx)
            shapes.add(len(idx))
    if not offsets:
        return
    if len(shapes) > 1:
        report.problem(
            "rng-layout-mixed", f"RNG states saved with different layouts side by side: {sorted(map(str, shapes))}"
        )
    dims = max(len(s) if isinstance(s, tuple) else s for s in shapes)
    ep = run.get("ep")
    if dims == 2:
        report["rng_layout"] = (
            "2-D (pp, tp): one RNG state per (pp, tp), written by data-parallel rank 0; "
            "under EP > 1 every EP rank > 0 resumes on another rank's stream"
        )
        if ep is not None and ep > 1:
            report.problem(
                "rng-2d-under-ep",
                f"RNG state is 2-D (pp, tp) and this run uses ep={ep}: EP ranks > 0 will resume on "
                "data-parallel rank 0's RNG streams (see fix rng-under-ep)",
            )
    else:
        report["rng_layout"] = f"{dims}-D: one RNG state per rank of every saved dimension (per EP rank)"
    for shape in (s for s in shapes if isinstance(s, tuple)):
        want = 1
        for s in shape:
            want *= s
        have = len({o for o in offsets if len(o) == len(shape)})
        if have != want:
            report.problem("rng-incomplete", f"RNG state grid {list(shape)} has {have} of {want} entries")
