"""selftest, running: the stack checks, the prepare hooks, one world per scenario half, progress lines.

Megatron's and the ranks' own output goes to a log file (see :func:`captured`); only progress lines
reach the terminal. Each half's per-rank results are read by :mod:`.selftest_judge`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time

from mcore_ckpt_fixes.engine import flags

from ..testing.states import ON
from .selftest_judge import describe_ranks, is_exact, rank_rows, skip_missing

_PROGRESS_FD = 2  # the terminal's stderr, kept while fds 1 and 2 point at the log (see captured)


def progress(text: str, end: str = "") -> None:
    os.write(_PROGRESS_FD, (text + end).encode("utf-8", "replace"))


@contextlib.contextmanager
def captured(log_path: str):
    """Send fds 1 and 2 to ``log_path`` while the worlds run: ranks (forked or spawned) share our
    file descriptors, and Megatron's warnings from every rank would bury the progress lines and
    corrupt ``--json``. Progress keeps writing to a duplicate of the original stderr."""
    global _PROGRESS_FD
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    _PROGRESS_FD = saved[1]
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _PROGRESS_FD = 2


def world(scenario, patched, device, nproc, run_world):
    from mcore_ckpt_fixes.testing.launcher import cuda_method

    backend, method = ("gloo", "fork") if device == "cpu" else ("nccl", cuda_method())
    env = {flags.GLOBAL_VAR: "auto"} if patched else scenario.off_env()
    ckpt_dir = tempfile.mkdtemp(prefix="mcore-ckpt-fixes-selftest-")
    start = time.monotonic()
    try:
        results = run_world(
            scenario.func,
            nproc,
            {"ckpt_dir": ckpt_dir, "patched": patched, "device": device},
            env=env,
            timeout=scenario.timeout,
            backend=backend,
            method=method,
        )
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return rank_rows(results), time.monotonic() - start


def run_scenario(scenario, needed, device, nproc, run_world, version=None):
    """Both halves of one scenario -> its JSON object (the static skip checks are the caller's)."""
    out = {"skipped": None, "reproduced": None, "exact": None}
    progress("fix off ... ")
    off, t_off = world(scenario, False, device, nproc, run_world)
    out["seconds"] = round(t_off, 1)
    missing = skip_missing(off)
    if missing:  # both halves would stop at the same import
        out["skipped"] = missing
        progress(f"skipped: {missing}", "\n")
        return out

    bug = scenario.bug_for(version) if needed is not False else None
    if bug is not None and bug.seen_in([r.get("_value") for r in off]):
        outcome, word = "documented-bug", "documented bug reproduced"
    elif all(is_exact(r) for r in off):
        outcome, word = "exact", "round trip exact"
    elif not all(r["ok"] for r in off):
        outcome, word = "crashed", "failed otherwise: " + describe_ranks(off)
    else:
        outcome, word = "other-failure", "failed otherwise: " + describe_ranks(off)
    out["reproduced"] = outcome == "documented-bug"
    out["fix_off"] = {
        "outcome": outcome,
        "observed": describe_ranks(off),
        "seconds": round(t_off, 1),
        # The documented failure's traceback says nothing new: keep tracebacks of surprises only.
        "ranks": [public(r, keep_traceback=outcome != "documented-bug") for r in off],
    }
    progress(f"{word} ({t_off:.1f} s); fix on ... ")

    on, t_on = world(scenario, True, device, nproc, run_world)
    out["seconds"] = round(t_off + t_on, 1)
    missing = skip_missing(on)
    if missing:
        out.update(skipped=missing, reproduced=None)
        progress(f"skipped: {missing}", "\n")
        return out
    exact = all(is_exact(r) for r in on)
    note = None
    states = [r["fix_state"] for r in on if r["ok"] and r["fix_state"]]
    # Each rank's targets: applied, or not needed on this release (a target whose code here has no
    # bug), and at least one applied: otherwise the round trip ran without the fix.
    if exact and needed is True and not all("applied" in s.values() and set(s.values()) <= set(ON) for s in states):
        exact, note = False, f"round trip exact, but the fix was not applied in every rank: {states}"
    out["exact"] = exact
    out["fix_on"] = {
        "observed": note or describe_ranks(on),
        "max_delta_per_rank": [r["max_delta"] for r in on],
        "n_tensors_per_rank": [r["n_tensors"] for r in on],
        "fix_state_per_rank": [r["fix_state"] for r in on],
        "seconds": round(t_on, 1),
        "ranks": [public(r) for r in on],
    }
    progress(f"{'exact' if exact else 'NOT EXACT'} ({t_on:.1f} s)", "\n")
    return out


def public(row, keep_traceback=True):
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    if out.get("error") is None or not keep_traceback:
        out.pop("traceback", None)
    return out


def stack(device, nproc):
    """(torch version or None, reason every scenario must be skipped or None)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return None, f"torch is not importable: {exc}"
    if not dist.is_available():
        return torch.__version__, "this torch build has no torch.distributed"
    if device == "cpu":
        if not dist.is_gloo_available():
            return torch.__version__, "this torch build has no gloo backend"
        return torch.__version__, None
    # --device cuda: untested by this project's CI (no GPU on its hosts); see the module docstring.
    if not torch.cuda.is_available():
        return torch.__version__, "CUDA is not available to this torch"
    if not dist.is_nccl_available():
        return torch.__version__, "this torch build has no NCCL backend"
    count = torch.cuda.device_count()
    if nproc is not None and count < nproc:
        return torch.__version__, f"--nproc {nproc} needs {nproc} GPUs, {count} visible"
    return torch.__version__, None


def gpus_short(device, nproc):
    """Why a --device cuda world of ``nproc`` ranks cannot run here (NCCL: one GPU per rank), or None."""
    if device != "cuda":
        return None
    import torch

    count = torch.cuda.device_count()
    return f"needs {nproc} GPUs (NCCL, one per rank), {count} visible" if count < nproc else None


def set_aside_user_flags():
    names = sorted(k for k in os.environ if k == flags.GLOBAL_VAR or k.startswith(flags.PER_FIX_PREFIX))
    found = {k: os.environ.pop(k) for k in names}
    return found


def prepare(scenarios):
    """Run each distinct prepare hook once, here in the parent. -> {hook: skip reason or error}."""
    from mcore_ckpt_fixes.testing import resolve

    problems = {}
    for hook in dict.fromkeys(s.prepare for s in scenarios if s.prepare):
        try:
            resolve(hook)()  # Megatron's import-time warnings go to the log (see captured)
        except ModuleNotFoundError as exc:
            problems[hook] = ("skip", f"missing dependency: No module named {exc.name!r}")
        except Exception as exc:
            problems[hook] = ("error", f"prepare {hook} raised {type(exc).__name__}: {exc}")
    return problems
