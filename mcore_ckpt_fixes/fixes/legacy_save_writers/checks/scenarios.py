"""legacy-save-writers' round trip as the suite and ``selftest`` find it (no torch, no Megatron here).

World 2 laid out TP=2, EP=1, expert TP=1, ``megatron.training``'s ``save_checkpoint`` /
``load_checkpoint`` in the legacy torch format (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# TP rank 1 has expert-DP rank 1: the release never writes its file.
UNWRITTEN = Bug.raises("files", "AssertionError: the save wrote no iter_0000001/mp_rank_01/model_optim_rng.pt")

SCENARIOS = (
    Scenario(
        ID,
        "tp2_ep1_etp1",
        f"{_CORE}:round_trip",
        2,
        {">=0.17.0,<0.18.0": UNWRITTEN},
        prepare=f"{_CORE}:prepare",
        requires=("megatron.training.checkpointing:save_checkpoint",),
        doc="MoE GPT, TP=2 with EP=1 and expert TP=1, saved and loaded by megatron.training in the legacy torch format",
    ),
)
