"""forked-save-writers' round trip as the suite and ``selftest`` find it (nothing heavy imported
here): a ``torch_dist`` save and load on 2 gloo ranks, then a save where rank 0 cannot fork
(checks/core.py). ``write_dies``, where a writer is killed, ends a rank with the fix on, so it is
run by the tests only."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Rank 0's save, where its forking writer starts the first bucket's process; every rank reports it.
FORK_FAILED = Bug.raises("fork_fails", "BlockingIOError: [Errno 11] Resource temporarily unavailable")
# Both ranks still waiting at the deadline (rank 0 on the count queue, rank 1 in the barrier): the
# lower rank's line, as every rank reports it.
HANG = Bug.raises("save", "TimeoutError: _save did not return within 10 s")

SCENARIOS = (
    Scenario(
        ID,
        "fork_fails",
        f"{_CORE}:fork_fails",
        2,
        FORK_FAILED,
        prepare=f"{_CORE}:prepare",
        timeout=120.0,
        devices=("cpu",),  # the writer writes host tensors; on a GPU host the same code runs after the copy
        applicable=f"{_CORE}:sync_save_runs_in_this_process",
        doc="torch_dist save and load (two buckets per rank), then a save where rank 0 cannot fork",
    ),
)
