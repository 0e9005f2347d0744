"""One failure, reported alike by every rank of a world (test and selftest worker processes only).

A rank that fails while its peers go on into a collective leaves them waiting until the world's
deadline, and each rank's result would then tell another story. A round trip that runs a step
through :func:`shared` (no collective inside that step can be left half-entered: the request
builders, Megatron's own validations) or :func:`through_files` (a step that is itself collective,
e.g. DCP's save, whose failure on one rank can leave the group unusable) gets the world's first
failure, the lowest failing rank's, on every rank as :class:`WorldFailed`.
"""

from __future__ import annotations

import os
import time
import traceback

import torch.distributed as dist

# What a step's failure is, besides Exception: torch DCP's CheckpointException derives from
# BaseException. Never caught: an interrupt, an exit, a closing generator.
_NOT_A_FAILURE = (KeyboardInterrupt, SystemExit, GeneratorExit)


def error_line(exc) -> str:
    """``Type: message``."""
    return f"{type(exc).__name__}: {exc}"


class WorldFailed(Exception):
    """The world's first failure, as every rank reports it: ``phase``, ``error`` (the failing rank's
    line), ``rank_errors`` (each rank's line, None where it did not fail) and ``traceback`` (this
    rank's, where this rank failed; else None)."""

    def __init__(self, phase, error, rank_errors, traceback=None):
        super().__init__(error)
        self.phase, self.error, self.rank_errors, self.traceback = phase, error, rank_errors, traceback


def shared(phase, fn, *args, line=error_line, **kwargs):
    """``fn(*args, **kwargs)`` on every rank; if it failed on any, every rank raises the lowest
    failing rank's :class:`WorldFailed` (``line``: how a failure is written)."""
    out, mine, tb = None, None, None
    try:
        out = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported as the world's result
        if isinstance(exc, _NOT_A_FAILURE):
            raise
        mine, tb = line(exc), traceback.format_exc()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = next((e for e in everyone if e is not None), None)
    if first is not None:
        raise WorldFailed(phase, first, everyone, tb)
    return out


def through_files(phase, fn, folder, line=error_line, wait=10.0):
    """``fn()``, a collective step: a failing rank writes its line to ``failed.rank<N>`` in
    ``folder`` (a shared file system: the group may be unusable now) and raises the lowest failing
    rank's :class:`WorldFailed`, waiting up to ``wait`` seconds for each lower rank's file."""
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, _NOT_A_FAILURE):
            raise
        rank, size = dist.get_rank(), dist.get_world_size()
        tb = traceback.format_exc()
        with open(os.path.join(folder, f"failed.rank{rank}"), "w") as f:
            f.write(line(exc))
        everyone = [_read_failure(folder, r, wait if r < rank else 0.0) for r in range(size)]
        raise WorldFailed(phase, next(e for e in everyone if e is not None), everyone, tb) from exc


def _read_failure(folder, rank, wait):
    path = os.path.join(folder, f"failed.rank{rank}")
    deadline = time.monotonic() + wait
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()
