"""``inspect`` on synthetic torch_dist checkpoints of 100k and 1M chunks: time, bytes read, peak RSS.

The checkpoint's ``.metadata`` is built from torch's own DCP classes and pickled the way DCP writes it
(``Metadata`` with every chunk and a ``storage_data`` entry per chunk); the ``.distcp`` files are sparse
files of the right length (the doctor only stats them). Bytes read come from ``/proc/self/io``
(``rchar``: every read syscall of this process, whatever opened the file), measured around
``inspect()`` after the doctor is imported, in a fresh interpreter per run so that its peak RSS
(``VmHWM``) is the doctor's own, not the builder's. Reported at 100k and 1M chunks: time, bytes
read (goal: at most 1.1 x the metadata size) and peak RSS (issue #22's goals at 1M: under 3 s, under
1 GB; measured before it: 5.2 s, 1.78 GB).

    PYTHONPATH=$ENVS/mcore-0.19.2:. $ENVS/py3.12/bin/python benchmarks/doctor_inspect.py [--chunks 100000 1000000]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile


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
    # The common state as dist_checkpointing writes it up to 0.18: the doctor walks its pickle record.
    torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                           expert_model_parallel_size=1), "iteration": 1},
               os.path.join(ckdir, "common.pt"))
    for rel, end in ends.items():
        with open(os.path.join(ckdir, rel), "wb") as f:
            f.truncate(end)  # sparse: right length, no data written
    return sum(len(m.chunks) for m in sdm.values())


_CHILD = """
import json, sys, time
from mcore_ckpt_fixes.doctor import inspect
def rchar():
    with open('/proc/self/io') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('rchar:'))
before, start = rchar(), time.perf_counter()
report = inspect(sys.argv[1])
seconds, read = time.perf_counter() - start, rchar() - before
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report the builder's peak.
with open('/proc/self/status') as f:
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))
print(json.dumps({"seconds": seconds, "bytes_read": read, "chunks": report["chunks"], "ok": report.ok,
                  "peak_rss_bytes": hwm}))
"""


def measure(root: str, runs: int) -> dict:
    """Each run in a fresh interpreter: its peak RSS is the doctor's own (not the builder's)."""
    import subprocess

    out = []
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", _CHILD, root], capture_output=True, text=True, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"seconds_median": round(statistics.median(r["seconds"] for r in out), 3),
            "seconds_all": [round(r["seconds"], 3) for r in out], "bytes_read_max": max(r["bytes_read"] for r in out),
            "peak_rss_max": max(r["peak_rss_bytes"] for r in out), "ok": all(r["ok"] for r in out),
            "chunks_seen": out[-1]["chunks"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=3)
    ns = ap.parse_args()
    failed = False
    for n_wanted in ns.chunks:
        with tempfile.TemporaryDirectory() as tmp:
            ckdir = os.path.join(tmp, "iter_0000001")
            n = build(ckdir, n_wanted)
            with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
            md_size = os.path.getsize(os.path.join(ckdir, ".metadata"))
            m = measure(tmp, ns.runs)
        ratio = m["bytes_read_max"] / md_size
        print(json.dumps({"chunks": n, "metadata_bytes": md_size, **m, "read_ratio": round(ratio, 4),
                          "python": sys.version.split()[0]}, indent=2))
        ok = m["ok"] and m["chunks_seen"] == n and ratio <= 1.1
        print(f"doctor_inspect: {n} chunks in {m['seconds_median']:.2f} s, read {m['bytes_read_max']} bytes = "
              f"{ratio:.3f} x the .metadata size (goal <= 1.1), peak RSS {m['peak_rss_max'] / 2**20:.0f} MiB: "
              f"{'PASS' if ok else 'FAIL'}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
