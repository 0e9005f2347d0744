"""``inspect`` on synthetic torch_dist checkpoints of 100k and 1M chunks: time, bytes read, peak RSS.

The checkpoint's ``.metadata`` is built from torch's own DCP classes and pickled the way DCP writes it
(``Metadata`` with every chunk and a ``storage_data`` entry per chunk); the ``.distcp`` files are sparse
files of the right length (the doctor only stats them). Bytes read come from ``/proc/self/io``
(``rchar``: every read syscall of this process, whatever opened the file), measured around
``inspect()`` after the doctor is imported, in a fresh interpreter per run so that its peak RSS
(``VmHWM``) is the doctor's own, not the builder's. Reported at 100k and 1M chunks: time, bytes
read (goal: at most 1.1 x the metadata size) and peak RSS (the goals at 1M: under 3 s, under
1 GB; measured before it: 5.2 s, 1.78 GB; with the allow-list unpickler: 6.37 s, 1607 MiB; with the
stream reader dcp_scan: 2.31 s, 277 MiB). ``--local-plans`` adds every rank's SavePlan as Megatron-Core's
torch_dist save keeps it (``all_local_plans``, about twice the bytes): 1M chunks 20.7 s / 3846 MiB
before, 3.81 s / 439 MiB with dcp_scan. Run it from outside the repository (``cd /tmp``) to measure
another checkout through PYTHONPATH: ``python -c`` puts the working directory first on sys.path.

    PYTHONPATH=$ENVS/mcore-0.19.2:. $ENVS/py3.12/bin/python benchmarks/doctor_inspect.py [--chunks 100000 1000000] [--local-plans]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile


def build(ckdir: str, n_chunks: int, per_tensor: int = 500, ranks: int = 64, local_plans: bool = False) -> int:
    """``local_plans``: also every rank's SavePlan in ``all_local_plans``, as Megatron-Core's torch_dist
    save keeps them (0.19.2 ``save_state_dict_async_plan``): a WriteItem per chunk, about twice the bytes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

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
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([rows * 4, cols * 8]), chunks
        )
    os.makedirs(ckdir, exist_ok=True)
    md = Metadata(state_dict_metadata=sdm, storage_data=storage)
    if local_plans:
        md.all_local_plans = _local_plans(sdm, ranks)
    with open(os.path.join(ckdir, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with open(os.path.join(ckdir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    # The common state as dist_checkpointing writes it up to 0.18: the doctor walks its pickle record.
    torch.save(
        {
            "args": argparse.Namespace(
                tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1
            ),
            "iteration": 1,
        },
        os.path.join(ckdir, "common.pt"),
    )
    for rel, end in ends.items():
        with open(os.path.join(ckdir, rel), "wb") as f:
            f.truncate(end)  # sparse: right length, no data written
    return sum(len(m.chunks) for m in sdm.values())


def _local_plans(sdm, ranks):
    """Each rank's SavePlan as rank 0 gathered it (gather_object: a copy of every other rank's plan;
    rank 0's own items share the index's chunk objects, as create_global_plan took them from it)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    items = [[] for _ in range(ranks)]
    for fqn, meta in sdm.items():
        for k, c in enumerate(meta.chunks):
            items[k % ranks].append(
                WriteItem(
                    index=MetadataIndex(fqn, c.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=c, properties=meta.properties, size=meta.size),
                )
            )
    return [SavePlan(it) if r == 0 else pickle.loads(pickle.dumps(SavePlan(it))) for r, it in enumerate(items)]


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
    return {
        "seconds_median": round(statistics.median(r["seconds"] for r in out), 3),
        "seconds_all": [round(r["seconds"], 3) for r in out],
        "bytes_read_max": max(r["bytes_read"] for r in out),
        "peak_rss_max": max(r["peak_rss_bytes"] for r in out),
        "ok": all(r["ok"] for r in out),
        "chunks_seen": out[-1]["chunks"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--local-plans",
        action="store_true",
        help="also write all_local_plans (every rank's SavePlan), as Megatron-Core's torch_dist save does",
    )
    ns = ap.parse_args()
    failed = False
    for n_wanted in ns.chunks:
        with tempfile.TemporaryDirectory() as tmp:
            ckdir = os.path.join(tmp, "iter_0000001")
            n = build(ckdir, n_wanted, local_plans=ns.local_plans)
            with open(os.path.join(tmp, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
            md_size = os.path.getsize(os.path.join(ckdir, ".metadata"))
            m = measure(tmp, ns.runs)
        ratio = m["bytes_read_max"] / md_size
        print(
            json.dumps(
                {
                    "chunks": n,
                    "local_plans": ns.local_plans,
                    "metadata_bytes": md_size,
                    **m,
                    "read_ratio": round(ratio, 4),
                    "python": sys.version.split()[0],
                },
                indent=2,
            )
        )
        ok = m["ok"] and m["chunks_seen"] == n and ratio <= 1.1
        print(
            f"doctor_inspect: {n} chunks in {m['seconds_median']:.2f} s, read {m['bytes_read_max']} bytes = "
            f"{ratio:.3f} x the .metadata size (goal <= 1.1), peak RSS {m['peak_rss_max'] / 2**20:.0f} MiB: "
            f"{'PASS' if ok else 'FAIL'}"
        )
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
