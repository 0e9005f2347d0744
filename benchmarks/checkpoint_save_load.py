"""What the fixes cost where users pay for checkpoints: ``save_checkpoint`` and ``load_checkpoint``
wall time of a job of over 100M parameters, fixes on against off, as ratios taken in one run.

Two layouts on 4 CPU ranks (gloo): a dense GPT, PP=2 x DP=2 (hidden 1024, 8 layers: 101M
parameters), and a MoE GPT, EP=2 on 4 ranks (DP=4, expert DP=2; hidden 1024, 6 layers, two experts: 126M);
the distributed optimizer (dp_reshardable), bf16, Megatron's own model, DDP, optimizer and
``megatron.training.checkpointing`` (:mod:`mcore_ckpt_fixes.testing.gpt_job`, one training step
first so that the optimizer has its state). In one world per layout, ROUNDS rounds, each saving and
loading once with the fixes applied and once with them reverted (``mcore_ckpt_fixes.revert()`` /
``apply()``), the order alternating from round to round; every save and every load is timed between
barriers (the slowest rank's time). Reported per layout: the median time of each, the ratios
fixes-on / fixes-off of those medians (goal: <= 1.02), and each round's own ratio (its two halves
ran back to back), sorted, with their median: their spread is the machine's noise; and the CPU
seconds the ranks' own processes spent in each (summed over the ranks, medians) with their ratio,
which that noise moves least; and, from one more save and load with the fixes under cProfile, the
seconds the slowest rank spent in the fixes' own code (package ``fixes`` and ``engine``) and their
share of the profiled time, and the bytes one save writes with the fixes and without: costs no
scheduling noise moves.

The checkpoints go to memory (``/dev/shm``) unless ``BENCH_CKPT_DIR`` names a directory: on a disk
the page cache's writeback makes two identical saves of 1.5 GB differ by 2-3x (measured: the same
4361 write calls took 0.30 s in one save and 1.11 s in the next), far more than the fixes' own
work, which is what this measures.

``BENCH_LAYOUTS`` (comma list of the names below) times only those layouts; ``BENCH_FIXES`` (comma
list of fix ids) switches only those fixes between the halves, the others staying applied in both:
what one fix costs.

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python benchmarks/checkpoint_save_load.py [ROUNDS]
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from mcore_ckpt_fixes.testing.job_config import Config

ROUNDS = 4
LAYOUTS = (
    Config("bench-dense-pp2-dp2", "dense GPT, PP=2 x DP=2", world=4, pp=2, hidden=1024, layers=8),
    Config("bench-moe-ep2", "MoE GPT, EP=2 on 4 ranks (DP=4, expert DP=2)", world=4, ep=2, hidden=1024, layers=6),
)


def _timed(fn):
    """(wall seconds between barriers, this process's CPU seconds) of ``fn``."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - start, cpu


def _toggled() -> list | None:
    """The fix ids whose cost is measured (None: every fix)."""
    named = os.environ.get("BENCH_FIXES", "").strip()
    return [f.strip() for f in named.split(",") if f.strip()] or None


def rank_main(rank, world_size, cfg, ckpt_dir, rounds):
    """One rank: build, train one step, then time the saves and loads with the fixes on and off."""
    import torch.distributed as dist
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.testing import gpt_job as job

    with job.worker(cfg, "cpu") as cpu_gen:
        args = job.parse_args(cfg, ckpt_dir, steps=2)
        job.initialize_parallel(cfg, args)
        model, optimizer, scheduler, feed = job.start(cfg, args, cpu_gen)
        job.train_steps(model, optimizer, scheduler, args, feed, 1, 1)
        times = {mode: {op: [] for op in ("save", "load", "save_cpu", "load_cpu", "bytes")} for mode in ("on", "off")}
        # Round -1 is not timed: the first save and load of a process pay for what every later one
        # reuses (the writer's worker processes, cached plans, the file system's first writes).
        for r in range(-1, rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                mcore_ckpt_fixes.revert(_toggled())
                if mode == "on":
                    mcore_ckpt_fixes.apply()
                iteration = 3 + 2 * r + (mode == "off")
                save = _timed(lambda: save_checkpoint(iteration, job.chunks(model), optimizer, scheduler, 0))
                load = _timed(lambda: job.load(load_checkpoint, model, optimizer, scheduler))
                if r >= 0:
                    for op, (wall, cpu) in (("save", save), ("load", load)):
                        times[mode][op].append(wall)
                        times[mode][f"{op}_cpu"].append(cpu)
                if rank == 0:
                    saved_dir = f"{ckpt_dir}/iter_{iteration:07d}"
                    if r >= 0:
                        times[mode]["bytes"].append(_bytes_under(saved_dir))
                    shutil.rmtree(saved_dir, ignore_errors=True)
        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()
        profiled = _own_time(lambda: save_checkpoint(99, job.chunks(model), optimizer, scheduler, 0))
        profiled_load = _own_time(lambda: job.load(load_checkpoint, model, optimizer, scheduler))
        total = [None] * world_size
        dist.all_gather_object(total, _own_parameters(model))
        return {"params": sum(total), "times": times, "own": {"save": profiled, "load": profiled_load}}


def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _own_time(fn) -> tuple:
    """(seconds spent in the fixes' own code, seconds profiled) of one ``fn`` under cProfile: the
    functions defined in the package's fixes and engine (not in the test stand-ins); what those
    functions make the release do (another object to write) is in the timed ratios, not here."""
    import cProfile
    import pstats

    import torch.distributed as dist

    dist.barrier()
    profile = cProfile.Profile()
    profile.runcall(fn)
    dist.barrier()
    stats = pstats.Stats(profile).stats
    package = os.path.dirname(os.path.abspath(__import__("mcore_ckpt_fixes").__file__))
    own_dirs = tuple(os.path.join(package, d) + os.sep for d in ("fixes", "engine"))
    own = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.items() if path.startswith(own_dirs))
    return own, sum(tt for (_, _, tt, _, _) in stats.values())


def _own_parameters(model) -> int:
    """This rank's parameters that no other rank holds a copy of: dense ones on data-parallel rank 0,
    expert ones on expert-data-parallel rank 0 (summed over the ranks: the model's size)."""
    from megatron.core import parallel_state as mpu

    from mcore_ckpt_fixes.testing import gpt_job as job

    dense_owner = mpu.get_data_parallel_rank() == 0
    expert_owner = mpu.get_expert_data_parallel_rank() == 0
    return sum(
        p.numel()
        for chunk in job.chunks(model)
        for p in chunk.parameters()
        if (expert_owner if not getattr(p, "allreduce", True) else dense_owner)
    )


def main(rounds: int) -> int:
    from mcore_ckpt_fixes.engine.version import detect
    from mcore_ckpt_fixes.resume import check
    from mcore_ckpt_fixes.testing.launcher import run_world

    check.prepare()
    rows = []
    wanted = {n.strip() for n in os.environ.get("BENCH_LAYOUTS", "").split(",") if n.strip()}
    unknown = wanted - {cfg.name for cfg in LAYOUTS}
    if unknown:
        print(f"BENCH_LAYOUTS: unknown {sorted(unknown)}; accepted: {[c.name for c in LAYOUTS]}", file=sys.stderr)
        return 2
    for cfg in LAYOUTS:
        if wanted and cfg.name not in wanted:
            continue
        where = os.environ.get("BENCH_CKPT_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        work = tempfile.mkdtemp(prefix="ckpt-bench-", dir=where)
        kwargs = {"cfg": cfg, "ckpt_dir": work, "rounds": rounds}
        results = run_world("__main__:rank_main", cfg.world, kwargs, timeout=3600, env={"MCORE_CKPT_FIXES": "auto"})
        shutil.rmtree(work, ignore_errors=True)
        bad = [r for r in results if not r.ok]
        if bad:
            print(f"{cfg.name}: rank {bad[0].rank} failed:\n{bad[0].error}", file=sys.stderr)
            return 1
        # Each rank timed the same barriers: the slowest rank's view is the wall time.
        wall = {
            mode: {
                op: [max(r.value["times"][mode][op][i] for r in results) for i in range(rounds)]
                for op in ("save", "load")
            }
            for mode in ("on", "off")
        }
        med = {mode: {op: statistics.median(wall[mode][op]) for op in ("save", "load")} for mode in ("on", "off")}
        # The two halves of one round ran back to back: their ratio, round by round, shows how far
        # the machine's own noise reaches (a shared 2-core host moves single saves by 10 % and more).
        paired = {
            op: sorted(round(a / b, 3) for a, b in zip(wall["on"][op], wall["off"][op])) for op in ("save", "load")
        }
        # CPU seconds of the ranks' own processes (the fixes' work runs there), summed over the ranks:
        # what the scheduler's noise moves least. The writer's worker processes are not counted.
        cpu = {
            mode: {
                op: statistics.median(
                    sum(r.value["times"][mode][f"{op}_cpu"][i] for r in results) for i in range(rounds)
                )
                for op in ("save", "load")
            }
            for mode in ("on", "off")
        }
        rows.append(
            {
                "layout": cfg.summary,
                "parameters": results[0].value["params"],
                "median_s": med,
                "ratio_save": round(med["on"]["save"] / med["off"]["save"], 3),
                "ratio_load": round(med["on"]["load"] / med["off"]["load"], 3),
                "paired_ratios": paired,
                "median_paired_ratio": {op: statistics.median(paired[op]) for op in ("save", "load")},
                "cpu_s_all_ranks": cpu,
                "cpu_ratio": {op: round(cpu["on"][op] / cpu["off"][op], 3) for op in ("save", "load")},
                # What one save writes (every file of its iteration directory; the same in every round).
                "bytes_written": {mode: max(results[0].value["times"][mode]["bytes"]) for mode in ("on", "off")},
                # One save and one load with the fixes, profiled: the slowest rank's seconds in the
                # fixes' own code, and their share of what it profiled.
                "fixes_own_code": {
                    op: {
                        "seconds": round(max(r.value["own"][op][0] for r in results), 4),
                        "share": round(max(r.value["own"][op][0] / r.value["own"][op][1] for r in results), 4),
                    }
                    for op in ("save", "load")
                },
            }
        )
    summary = {"megatron_core": str(detect().version), "rounds": rounds, "fixes": _toggled() or "all"}
    print(json.dumps({**summary, "layouts": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS))
