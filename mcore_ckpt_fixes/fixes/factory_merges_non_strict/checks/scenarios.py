"""factory-merges-non-strict's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here). World 2 (TP=2): a one-layer SwiGLU GPT saved with dist_checkpointing and loaded with
an MTP layer added under each strictness (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The release's ValueError names every key of the request; the round trip says it in one line.
STOPPED = "AssertionError: a load under a strictness that tolerates missing keys stopped in apply_factory_merges"

SCENARIOS = (
    Scenario(
        ID,
        "mtp_layer_added",
        f"{_CORE}:round_trip",
        2,
        {">=0.12.0,<=0.19.2": Bug.raises("load", STOPPED)},
        prepare=f"{_CORE}:prepare",
        # What it checks is which keys a strictness merges; its model is built on the host on every
        # host (checks/core.py), so a CUDA run would repeat the CPU one.
        devices=("cpu",),
        doc="a one-layer SwiGLU GPT (TP=2) saved with dist_checkpointing and loaded with a multi-token-prediction "
        "layer added under assume_ok_unexpected (the release's own refusal), log_all, ignore_all and return_all: "
        "every saved tensor exact, the MTP layer's keys not loaded",
    ),
)
