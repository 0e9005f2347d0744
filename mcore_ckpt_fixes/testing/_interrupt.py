"""A rank that dies in the middle of a save (test and selftest worlds only).

``dies_after_writing(rank)``: this process, if it is global rank ``rank``, is killed (SIGKILL, as
the node's loss or the job scheduler would kill it) the moment torch DCP hands its write results to
the save's coordinator: its own shards are on disk, the checkpoint's metadata and Megatron's tracker
file are not. The other ranks then stop in the save's collective (gloo reports the lost peer).
"""

from __future__ import annotations

import contextlib
import os
import signal


def _is_write_results(obj) -> bool:
    return isinstance(obj, list) and bool(obj) and all(type(r).__name__ == "WriteResult" for r in obj)


@contextlib.contextmanager
def dies_after_writing(rank: int):
    import torch.distributed as dist
    from torch.distributed.checkpoint.utils import _DistWrapper

    original = _DistWrapper.__dict__["gather_object"]

    def gather_object(self, obj):
        if dist.get_rank() == rank and _is_write_results(obj):
            # The rank and every process it started (0.19's writer workers): none may keep its
            # connections to the other ranks open, as none would on a lost node.
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return original(self, obj)

    _DistWrapper.gather_object = gather_object
    try:
        yield
    finally:
        _DistWrapper.gather_object = original
