"""Run a scenario on N ranks and hand every rank's result, or its traceback, back to the caller.

Two ways to start ranks:

* ``fork`` (CPU/gloo default): children of a parent that already imported torch and Megatron-Core,
  so a fresh world costs milliseconds instead of the 15 s of importing everything again.
* ``spawn``: fresh interpreters (``python -m mcore_ckpt_fixes.testing.worker``); for CUDA where
  this process cannot hand a fork a usable GPU (:func:`cuda_method` decides).

Every world has a deadline: when one rank dies before a collective the others would wait forever,
so the parent kills the whole world at the deadline and reports which ranks never finished.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error: Optional[str] = None  # traceback text, or why the rank produced nothing


class WorldError(AssertionError):
    """At least one rank failed, crashed or timed out."""


def cuda_method() -> str:
    """How to start ranks that will use CUDA: ``fork`` from this warm process (no import of torch
    and Megatron again: most of a world's cost) where a forked child can still initialise CUDA on
    its own, else ``spawn``. A fork inherits no CUDA state: it cannot be used once this process
    initialised CUDA, nor where the driver was initialised here some other way (a device count
    asked of the runtime, say), which only a child can tell. So each call forks a child that puts
    one tensor on the GPU and exits: ``fork`` only if it could."""
    torch = sys.modules.get("torch")
    if sys.platform == "win32" or torch is None or torch.cuda.is_initialized():
        return "spawn"
    pid = os.fork()
    if pid == 0:  # child: never returns into the caller's stack
        code = 1
        try:
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
            code = 0
        except BaseException:
            pass
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60.0  # a child stuck in the driver is a no as well
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return "fork" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "spawn"
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "spawn"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_intra_op_thread() -> None:
    """In a forked rank: torch's CPU ops on one thread. OpenMP's thread pool does not survive
    ``fork()``: where the parent already ran a parallel op (pytest's process, after an earlier test),
    the rank's first parallel op (filling a DDP buffer, say) waits forever for pool threads it does
    not have. With one thread torch never enters that pool; a rank of a small CPU world gets about
    one core anyway, and every rank of every run of a check gets the same setting."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def run_world(
    scenario: str,
    nproc: int,
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    timeout: float = 180.0,
    backend: str = "gloo",
    method: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[RankResult]:
    """Run ``scenario`` ("package.module:function") on ``nproc`` ranks.

    ``env`` is applied in every rank before anything runs there (fix flags go here). A world whose
    rendezvous port another process took between :func:`free_port` and rank 0's bind (``EADDRINUSE``:
    nothing of the scenario ran) is started once more on another port.
    """
    results = _run_world_once(scenario, nproc, kwargs, timeout, backend, method, env)
    if any(not r.ok and r.error and "EADDRINUSE" in r.error for r in results):
        results = _run_world_once(scenario, nproc, kwargs, timeout, backend, method, env)
    return results


def _run_world_once(scenario, nproc, kwargs, timeout, backend, method, env) -> List[RankResult]:
    method = method or ("spawn" if backend == "nccl" else "fork")
    if method == "fork" and sys.platform == "win32":
        method = "spawn"
    workdir = tempfile.mkdtemp(prefix="mcore-ckpt-fixes-world-")
    job = {
        "scenario": scenario,
        "nproc": nproc,
        "kwargs": kwargs or {},
        "backend": backend,
        "init_method": f"tcp://127.0.0.1:{free_port()}",
        "timeout": timeout,
        "env": env or {},
    }
    job_path = os.path.join(workdir, "job.pkl")
    with open(job_path, "wb") as f:
        pickle.dump(job, f)
    result_paths = [os.path.join(workdir, f"rank{r}.pkl") for r in range(nproc)]

    if method == "fork":
        from . import _arg_docs
        from .worker import run_rank

        _arg_docs.warm()  # read once here, looked up in every forked rank
        pids = []
        for rank in range(nproc):
            pid = os.fork()
            if pid == 0:  # child: never returns into the caller's stack (pytest's, say)
                code = 1
                # A process group of its own: what the rank starts (Megatron's checkpoint-writer
                # manager and writer processes) goes with it when the parent kills the group.
                os.setpgid(0, 0)
                try:
                    _one_intra_op_thread()
                    code = run_rank(job, rank, result_paths[rank])
                except BaseException:  # not even an error result was written: say why, then exit
                    import traceback

                    traceback.print_exc()
                finally:
                    # Megatron's checkpoint writer starts a multiprocessing Manager on first save;
                    # os._exit skips the atexit hook that shuts it down, leaving orphans that hold
                    # the caller's stdout open. Run that hook (it ignores the parent's finalisers).
                    try:
                        import multiprocessing.util

                        multiprocessing.util._exit_function()
                    except Exception:
                        pass
                    os._exit(code)
            with contextlib.suppress(OSError):  # also from here: no window where the group is unset
                os.setpgid(pid, pid)
            pids.append(pid)
        alive, ended = _wait_pids(pids, timeout, result_paths)
    else:
        procs = []
        child_env = dict(os.environ, **(env or {}))  # PYTHONPATH and friends matter at start-up
        for rank in range(nproc):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "mcore_ckpt_fixes.testing.worker", job_path, str(rank), result_paths[rank]],
                    start_new_session=True,
                    env=child_env,
                )
            )
        alive, ended = _wait_procs(procs, timeout)

    try:
        return _collect(result_paths, alive, timeout, ended)
    finally:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def _how_it_ended(status: Optional[int]) -> str:
    """A rank's end as its exit status says it: a negative status is the signal that ended it."""
    if status is None:
        return "crashed?"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _collect(result_paths, alive, timeout, ended=None):
    """Every rank's result; ``ended``: each finished rank's exit status (negative: the signal)."""
    ended = ended or {}
    results = []
    for rank, path in enumerate(result_paths):
        if rank in alive:
            error = f"rank {rank} did not finish within {timeout:.0f} s (killed)"
            stack = _read_stack(path + ".stack")
            if stack:
                error += f"; where it waited, just before the deadline:\n{stack}"
            results.append(RankResult(rank, False, error=error))
            continue
        try:
            with open(path, "rb") as f:
                status, payload = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            how = _how_it_ended(ended.get(rank))
            results.append(RankResult(rank, False, error=f"rank {rank} exited without a result ({how})"))
            continue
        results.append(
            RankResult(rank, status == "ok", payload if status == "ok" else None, None if status == "ok" else payload)
        )
    return results


def _read_stack(path: str, limit: int = 4000) -> str:
    """The stack dump a hung rank wrote before the deadline (worker.py): its first ``limit`` characters,
    the innermost frames (faulthandler writes the most recent call first)."""
    try:
        with open(path) as f:
            return f.read()[:limit].strip()
    except OSError:
        return ""


def _lost_the_port(result_path: str) -> bool:
    """Did this rank stop because another process held the rendezvous port (``EADDRINUSE``)?"""
    try:
        with open(result_path, "rb") as f:
            status, payload = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return False
    return status == "error" and "EADDRINUSE" in str(payload)


def _wait_pids(pids: List[int], timeout: float, result_paths=()):
    """The ranks still running at the deadline (killed), and each other rank's exit status. Where
    rank 0 lost the rendezvous port to another process, the others would wait on that stranger's
    socket until the deadline: they are killed at once, and :func:`run_world` starts the world again."""
    deadline = time.monotonic() + timeout
    pending = {pid: rank for rank, pid in enumerate(pids)}
    ended = {}
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rank = pending.pop(pid)
                ended[rank] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                if rank < len(result_paths) and _lost_the_port(result_paths[rank]):
                    deadline = time.monotonic()  # the loop ends; the others are killed below
        time.sleep(0.02)
    for pid in pending:
        try:
            os.killpg(pid, signal.SIGKILL)  # the rank and everything it started
            os.waitpid(pid, 0)
        except OSError:
            pass
    for pid in pids:
        # A rank that exited may leave processes of its group behind (a manager server of a rank
        # killed mid-save, say); they would keep the caller's stdout open and outlive the world.
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    return set(pending.values()), ended


def _wait_procs(procs, timeout: float):
    """As :func:`_wait_pids`, for spawned ranks."""
    deadline = time.monotonic() + timeout
    alive = set()
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            alive.add(rank)
    for rank in alive:
        try:
            os.killpg(procs[rank].pid, signal.SIGKILL)
        except OSError:
            pass
        procs[rank].wait()
    return alive, {rank: p.returncode for rank, p in enumerate(procs) if rank not in alive}


def values(results: List[RankResult]) -> List[Any]:
    """Every rank's value, or a :class:`WorldError` naming each failed rank and its traceback."""
    bad = [r for r in results if not r.ok]
    if bad:
        raise WorldError("\n".join(f"--- rank {r.rank} failed:\n{r.error}" for r in bad))
    return [r.value for r in results]
