"""The checkpoint doctor: what is on disk, and whether a run with given sizes can read it.

Used by ``mcore-ckpt-fixes inspect`` and callable by loaders::

    from mcore_ckpt_fixes.doctor import diagnose, shard_dir
    report = diagnose("/ckpt", tp=2, pp=1, ep=2)      # never raises for a bad checkpoint
    if not report.ok: print(report.render())
    shard_dir("/ckpt", 1000, tp_rank=1, ep_rank=1, pp=1, ep=2)  # '/ckpt/iter_0001000/mp_rank_01_001'

Reads metadata only and runs no code from the checkpoint (see safe_pickle). Imports no fix, no
Megatron and no torch.
"""

from __future__ import annotations

import os
from typing import Optional

from .core import inspect
from .legacy import expected_dirnames, layout_of, shard_dirname
from .report import Report, Unreadable
from .tracker import iteration_dirname

__all__ = ["inspect", "diagnose", "shard_dir", "expected_dirnames", "layout_of", "Report", "Unreadable"]


def shard_dir(
    root: str, iteration: Optional[int], tp_rank: int, pp_rank: int = 0, ep_rank: int = 0, *, pp: int = 1, ep: int = 1
) -> str:
    """The legacy shard directory Megatron writes (and reads) for one rank: ``root/iter_{:07d}/mp_rank_...``
    (``iteration=None``: the ``release`` directory). pp and ep are the run's sizes: each index is in the
    name only when its size is > 1."""
    for name, v, size in (("tp_rank", tp_rank, None), ("pp_rank", pp_rank, pp), ("ep_rank", ep_rank, ep)):
        if v < 0 or (size is not None and v >= size):
            raise ValueError(f"{name}={v} is outside 0..{(size or 1) - 1}")
    return os.path.join(
        root, iteration_dirname(iteration), shard_dirname(tp_rank, pp_rank, ep_rank, pp_size=pp, ep_size=ep)
    )


def diagnose(
    root: str,
    iteration: Optional[int] = None,
    *,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    ep: Optional[int] = None,
    verify_hashes: bool = False,
) -> Report:
    """As :func:`inspect`, but an unreadable input is a problem with code ``unreadable`` in the report."""
    try:
        return inspect(root, tp=tp, pp=pp, ep=ep, iteration=iteration, verify_hashes=verify_hashes)
    except Unreadable as exc:
        report = Report(os.path.abspath(root))
        report.problem("unreadable", str(exc))
        report.unreadable = True
        return report
