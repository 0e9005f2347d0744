"""``inspect`` on a synthetic torch_dist checkpoint with 100k chunks: time and bytes read.

The checkpoint's ``.metadata`` is built from torch's own DCP classes and pickled the way DCP writes it
(``Metadata`` with every chunk and a ``storage_data`` entry per chunk); the ``.distcp`` files are sparse
files of the right length (the doctor only stats them). Bytes read come from ``/proc/self/io``
(``rchar``: every read syscall of this process, whatever opened the file), measured around
``inspect()`` after the doctor is imported. Goals: under 2 s, at most 1.1 x the metadata size.

    PYTHONPATH=$ENVS/mcore-0.19.2:. $ENVS/py3.12/bin/python benchmarks/doctor_inspect.py [--chunks 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time


def build(ckdir: str, n_chunks: int, per_tensor: int = 500, ranks: int = 64) -> int:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)

    rows, cols = 25, per_tensor // 25  # a 25 x 20 grid of (4, 8) chunks per tensor
    sdm, storage, ends = {}, {}, {}
    for t in range(n_chunks // per_tensor):
        fqn = f"decoder.layers.{t}.mlp.linear_fc1.weight"
        chunks = []
        for i in range(rows):
            for j in range(cols):
                off = torch.Size([i * 4, j * 8])
                chunks.append(ChunkStorageMetadata(offsets=off, sizes=torch.Size([4, 8])))
                rel = f"__{(i * cols + j) % ranks}_0.distcp"
                start = ends.get(rel, 0)
                storage[MetadataIndex(fqn, off)] = _StorageInfo(relative_path=rel, offset=start, length=128)
                ends[rel] = start + 128
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows * 4, cols * 8]), chunks)
    os.makedirs(ckdir, exist_ok=True)
    with open(os.path.join(ckdir, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sdm, storage_data=storage), f)
    with open(os.path.join(ckdir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    with open(os.path.join(ckdir, "common.pt"), "wb") as f:
        f.write(b"\0" * 4096)  # never read by the doctor
    for rel, end in ends.items():
        with open(os.path.join(ckdir, rel), "wb") as f:
            f.truncate(end)  # sparse: right length, no data written
    return sum(len(m.chunks) for m in sdm.values())


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckdir = os.path.join(tmp, "iter_0000001")
        n = build(ckdir, ns.chunks)
        with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
        md_size = os.path.getsize(os.path.join(ckdir, ".metadata"))
        from mcore_ckpt_fixes.doctor import inspect

        times, reads = [], []
        for _ in range(ns.runs):
            before = rchar()
            start = time.perf_counter()
            report = inspect(tmp)
            times.append(time.perf_counter() - start)
            reads.append(rchar() - before)
        assert report.ok and report["chunks"] == n, report.problems
    t, b = statistics.median(times), max(reads)
    print(json.dumps({
        "chunks": n, "metadata_bytes": md_size, "seconds_median": round(t, 3),
        "seconds_all": [round(x, 3) for x in times], "bytes_read_max": b, "read_ratio": round(b / md_size, 4),
        "doctor_bytes_read": report.bytes_read, "python": sys.version.split()[0],
    }, indent=2))
    ok = t < 2.0 and b <= 1.1 * md_size
    print(f"doctor_inspect: {n} chunks in {t:.2f} s (goal < 2 s), read {b} bytes = {b / md_size:.3f} x the "
          f".metadata size (goal <= 1.1): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
