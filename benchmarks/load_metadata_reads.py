"""What a patched load reads and costs beside an unpatched one: bytes read per rank
(``/proc/self/io`` rchar) and load wall time, patched / unpatched, on a torch_dist checkpoint with
at least 100k chunks, world 2 (gloo, CPU), two cases:

* ``rng``: the checkpoint an unfixed 0.17-0.19 writes (RNG state in the old 2-D ``(pp, tp)``
  layout), loaded through ``megatron.training.checkpointing._load_global_dist_base_checkpoint``:
  unpatched with the release's request, patched with the fix's per-rank request, which the fix's
  load side answers from the checkpoint's metadata (old layout: with its warning).
* ``mimo``: every key under ``mimo.language.`` (the MIMO optimizer layout), loaded through
  ``dist_checkpointing.load``, which mimo-optimizer wraps (it decides the key layout from the
  checkpoint's metadata).

Each load runs in a fresh world (fix on or off by ``MCORE_CKPT_FIXES``), unpatched and patched
interleaved, REPEATS times; medians per rank; ratios per rank, the worse rank reported.
Goals: bytes <= 1.001, time <= 1.01.

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python benchmarks/load_metadata_reads.py [TENSORS] [REPEATS]

TENSORS tensors, each cut in two rows over the two data-parallel ranks: 2 x TENSORS chunks
(default 50,000 tensors = 100,000 chunks).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import types
import warnings

ITERATION = 1


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _tensors(n, prefix, rank, fill):
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    # One row of a (2, 4) tensor per data-parallel rank: two chunks per tensor in the checkpoint.
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"{prefix}t{i}", torch.full((1, 4), fill + i % 7, dtype=torch.float32), (0, rank, 2)
        )
        for i in range(n)
    }


def _rng_object(rank, per_rank):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{"rank": rank, "stream": list(range(8))}]
    if per_rank:  # the fix's request (pp, tp, dp_cp)
        return ShardedObject("rng_state", state, (1, 1, 2), (0, 0, rank), replica_id=0)
    return ShardedObject("rng_state", state, (1, 1), (0, 0), replica_id=rank)  # the release's


def save(rank, world_size, root, tensors, device="cpu"):
    """Write both checkpoints as unfixed Megatron-Core does (run with the fixes off)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    try:
        rng_dir = os.path.join(root, "rng", f"iter_{ITERATION:07d}")
        mimo_dir = os.path.join(root, "mimo")
        for d in (rng_dir, mimo_dir):
            if rank == 0:
                os.makedirs(d, exist_ok=True)
        dist.barrier()
        request = _tensors(tensors, "model.", rank, 1.0)
        request["rng_state"] = _rng_object(rank, per_rank=False)
        dist_checkpointing.save(request, rng_dir)
        dist_checkpointing.save(_tensors(tensors, "mimo.language.optimizer.state.", rank, 2.0), mimo_dir)
        dist.barrier()
        size = os.path.getsize(os.path.join(rng_dir, ".metadata"))
        return {"metadata_bytes": size, "chunks": 2 * tensors}
    finally:
        parallel_state.destroy_model_parallel()


def _args():
    # What _load_global_dist_base_checkpoint reads of Megatron's arguments (their defaults).
    return types.SimpleNamespace(
        ckpt_assume_constant_structure=False,
        stream_ckpt_dequant=True,
        ckpt_fully_parallel_load=False,
        ckpt_load_validate_sharding_integrity=False,
        dist_ckpt_strictness="assume_ok_unexpected",
        verify_integrity=False,
    )


def load(rank, world_size, root, tensors, case, patched, device="cpu"):
    """One load; bytes read and wall time of the load call alone."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    try:
        if case == "rng":
            from megatron.training import checkpointing

            request = _tensors(tensors, "model.", rank, 0.0)
            request["rng_state"] = _rng_object(rank, per_rank=patched)

            def call():
                return checkpointing._load_global_dist_base_checkpoint(
                    os.path.join(root, "rng"), _args(), False, request, ITERATION, False
                )[0]
        else:
            request = _tensors(tensors, "mimo.language.optimizer.state.", rank, 0.0)

            def call():
                return dist_checkpointing.load(request, os.path.join(root, "mimo"))

        dist.barrier()
        before, start = _rchar(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the old layout's MegatronPatchWarning (tests assert it)
            loaded = call()
        seconds, read = time.perf_counter() - start, _rchar() - before
        wrong = [
            k
            for k in ("t0", f"t{tensors - 1}")
            if float(loaded[k][0, 0]) != (1.0 if case == "rng" else 2.0) + int(k[1:]) % 7
        ]
        assert not wrong, f"loaded values differ: {wrong}"
        rng = loaded.get("rng_state") if case == "rng" else None
        return {
            "seconds": seconds,
            "rchar": read,
            # the RNG entry this rank got: saved by rank 0 (the one old-layout copy) on every rank
            "rng_saved_by": rng[0]["rank"] if isinstance(rng, list) else None,
            "wrapped": bool(getattr(checkpointing._load_global_dist_base_checkpoint, "__mcore_ckpt_fix__", None))
            if case == "rng"
            else None,
        }
    finally:
        parallel_state.destroy_model_parallel()


def main(tensors: int, repeats: int) -> int:
    from mcore_ckpt_fixes.testing.launcher import run_world, values

    # The warm parent the ranks fork from, with what a MIMO training run has imported: the fixes'
    # targets (megatron.training's checkpointing; the MIMO optimizer, whose fix wraps the load).
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.mimo.optimizer  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    from mcore_ckpt_fixes.engine.version import detect

    off = {"MCORE_CKPT_FIXES": "off"}
    out = {"megatron_core": str(detect().version), "tensors": tensors, "repeats": repeats, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="metadata-reads-") as root:
        saved = values(run_world(f"{__name__}:save", 2, {"root": root, "tensors": tensors}, env=off, timeout=1800))
        out["checkpoint"] = saved[0]
        for case in ("rng", "mimo"):
            runs = {False: [], True: []}
            for _ in range(repeats):
                for patched in (False, True):
                    env = off if not patched else {}
                    kwargs = {"root": root, "tensors": tensors, "case": case, "patched": patched}
                    runs[patched].append(values(run_world(f"{__name__}:load", 2, kwargs, env=env, timeout=1800)))
            per_rank = []
            for rank in range(2):
                med = {
                    p: {k: statistics.median(r[rank][k] for r in runs[p]) for k in ("seconds", "rchar")} for p in runs
                }
                per_rank.append(
                    {
                        "unpatched": med[False],
                        "patched": med[True],
                        "bytes_ratio": round(med[True]["rchar"] / med[False]["rchar"], 5),
                        "time_ratio": round(med[True]["seconds"] / med[False]["seconds"], 4),
                        "wrapped": {
                            "unpatched": runs[False][0][rank]["wrapped"],
                            "patched": runs[True][0][rank]["wrapped"],
                        },
                        "rng_saved_by": {
                            "unpatched": runs[False][0][rank]["rng_saved_by"],
                            "patched": runs[True][0][rank]["rng_saved_by"],
                        },
                    }
                )
            out["cases"][case] = {
                "per_rank": per_rank,
                "bytes_ratio": max(r["bytes_ratio"] for r in per_rank),
                "time_ratio": max(r["time_ratio"] for r in per_rank),
            }
    out["goals"] = {"bytes_ratio_at_most": 1.001, "time_ratio_at_most": 1.01}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    __name__ = "benchmarks.load_metadata_reads"  # noqa: A001  (the ranks import this module by that name)
    sys.modules[__name__] = sys.modules["__main__"]
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000, int(sys.argv[2]) if len(sys.argv) > 2 else 3))
