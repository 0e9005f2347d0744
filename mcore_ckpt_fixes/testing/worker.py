"""One rank of a world started by :mod:`mcore_ckpt_fixes.testing.launcher`."""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import pickle
import sys
import traceback

from . import _arg_docs


def _write(path: str, status: str, payload) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump((status, payload), f)
    os.replace(tmp, path)  # the parent never reads half a result


def _arm_stack_dump(job: dict, result_path: str):
    """Shortly before the world's deadline, write every thread's stack to ``<result>.stack``: when a
    rank hangs in a collective the parent kills it, and this says where it waited."""
    import faulthandler

    f = open(result_path + ".stack", "w")
    faulthandler.dump_traceback_later(max(1.0, float(job["timeout"]) - 3.0), exit=False, file=f)
    return f


def run_rank(job: dict, rank: int, result_path: str) -> int:
    import faulthandler

    stack_file = _arm_stack_dump(job, result_path)
    try:
        return _run_rank(job, rank, result_path)
    finally:
        faulthandler.cancel_dump_traceback_later()
        stack_file.close()


def _run_rank(job: dict, rank: int, result_path: str) -> int:
    try:
        os.environ.update(job["env"])
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["nproc"]))
        import torch
        import torch.distributed as dist

        if job["backend"] == "gloo":
            from . import _cpu_shims as cpu_shims

            cpu_shims.install()  # a no-op where CUDA is available
        if torch.cuda.is_available():
            # NCCL needs one GPU per rank; a gloo world on a GPU host (CUDA tensors, fewer GPUs
            # than ranks) shares them round-robin, its tensor collectives through the host.
            torch.cuda.set_device(rank % torch.cuda.device_count())
            if job["backend"] == "gloo":
                from . import _gloo_cuda

                _gloo_cuda.install()

        from . import _standins

        _standins.install_fp8_param_shard_stand_in()  # 0.12.x without Transformer Engine

        # Re-read the fix flags of this world: a forked rank inherits the parent's patch state.
        import mcore_ckpt_fixes

        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()

        dist.init_process_group(
            job["backend"],
            init_method=job["init_method"],
            rank=rank,
            world_size=job["nproc"],
            timeout=datetime.timedelta(seconds=job["timeout"]),
        )
        _fork_checkpoint_results_queue()
        _arg_docs.install()
        module_name, func_name = job["scenario"].split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        try:
            value = func(rank, job["nproc"], **job["kwargs"])
            # The result first: tearing the world down is not part of the round trip, and with
            # torch 2.6 and gloo, destroy_process_group() sometimes never returns on one rank.
            _write(result_path, "ok", value)
        finally:
            if job["backend"] != "gloo":  # gloo needs no teardown: this process exits right after
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
        return 0
    except BaseException:
        _write(result_path, "error", traceback.format_exc())
        return 1


def _fork_checkpoint_results_queue() -> None:
    """Have this rank create Megatron's checkpoint-writer results queue with a forked manager.

    Megatron's synchronous torch_dist save hands its write results back through a
    ``multiprocessing`` manager queue that it creates on first use in ``spawn`` mode: a fresh
    interpreter per rank that imports torch, 5-10 s of every saving world on a small CPU host.
    Megatron's own persistent async worker creates the same per-process queue in ``fork`` mode
    (``megatron.training.async_utils``). Here the first save asks for ``fork`` by default, in this
    rank only; a world that never saves starts no manager. Only where the parent imported the
    writer already (forked ranks): a spawned rank must not import Megatron before its scenario does.
    Before 0.17 the function is ``_get_write_results_queue()``, always ``spawn``: the same queue is
    made here with a forked manager and kept where the release keeps it (``_results_queue``).
    Releases with neither are left as they are."""
    import inspect

    module = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    original = getattr(module, "get_write_results_queue", None)
    if original is None:
        if callable(getattr(module, "_get_write_results_queue", None)) and hasattr(module, "_results_queue"):
            module._get_write_results_queue = functools.partial(_forked_results_queue, module)
        return
    if "mp_mode" not in inspect.signature(original).parameters:
        return

    def get_write_results_queue(mp_mode="fork"):
        return original(mp_mode=mp_mode)

    module.get_write_results_queue = get_write_results_queue


def _forked_results_queue(module):
    """``_get_write_results_queue`` of releases before 0.17, with a forked manager."""
    import multiprocessing

    if module._results_queue is None:
        module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
    return module._results_queue


def main(argv=None) -> int:
    job_path, rank, result_path = (argv or sys.argv[1:])[:3]
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    return run_rank(job, int(rank), result_path)


if __name__ == "__main__":
    sys.exit(main())
