"""One rank of one run of the resume check on a user's own job, started by the user's launcher:

    MCORE_CKPT_FIXES=off torchrun --nnodes ... -m mcore_ckpt_fixes.resume.own_rank DIR uninterrupted off

(or under ``srun``: the rank and world come from ``SLURM_PROCID`` / ``SLURM_NTASKS`` where torchrun's
variables are absent, the rendezvous from ``MASTER_ADDR`` / ``MASTER_PORT``). ``DIR`` holds the plan
that ``selftest --resume --print-launch`` wrote; each rank writes its result beside it and
``selftest --resume --compare DIR`` judges them. On a GPU host each rank takes its local GPU and
NCCL; on a CPU host gloo and the CPU stand-ins.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys

USAGE = "usage: python -m mcore_ckpt_fixes.resume.own_rank DIR {uninterrupted,save,resume} {on,off}"


def _rank_and_world():
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS"))
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if rank is None or world is None:
        raise SystemExit(
            "own_rank: no RANK/WORLD_SIZE (torchrun) or SLURM_PROCID/SLURM_NTASKS (srun) in the environment"
        )
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=local)
    return int(rank), int(world), int(local)


def use_mode(mode) -> None:
    """The fix flags of ``mode`` (``on``: every fix at its default, ``off``: none), whatever the shell
    set: ``python -m`` imported the package, and read its flags, before this module ran."""
    for name in [k for k in os.environ if k.startswith("MCORE_CKPT_FIX_")]:
        del os.environ[name]
    os.environ["MCORE_CKPT_FIXES"] = "off" if mode == "off" else "auto"
    import mcore_ckpt_fixes

    mcore_ckpt_fixes.revert()
    mcore_ckpt_fixes.apply()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[1] not in ("uninterrupted", "save", "resume") or argv[2] not in ("on", "off"):
        print(USAGE, file=sys.stderr)
        return 2
    directory, phase, mode = argv
    rank, world, local = _rank_and_world()
    use_mode(mode)
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    else:
        from ..testing import _cpu_shims as cpu_shims

        cpu_shims.install()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    write_result(rank, world, directory, phase, mode, device="cuda" if cuda else "cpu")
    return 0


def write_result(rank, world, directory, phase, mode, device="cpu"):
    """This rank's run of ``phase`` (its process group up, its fix flags those of ``mode``), its
    result written where :func:`.own_job.read_results` looks; also a world entry point for
    :func:`mcore_ckpt_fixes.testing.launcher.run_world`."""
    from ..testing import gpt_job
    from .own_job import SAVE_AT, STEPS, read_plan, result_path

    cfg = read_plan(os.path.join(directory, "plan.json"))
    ckpt = os.path.join(directory, f"checkpoint-{mode}")
    value = gpt_job.run(rank, world, cfg, phase, ckpt, STEPS, SAVE_AT, device=device)
    path = result_path(directory, (phase, mode), rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
