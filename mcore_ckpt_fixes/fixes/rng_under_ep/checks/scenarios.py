"""rng-under-ep's round trips as the suite and ``selftest`` find them (no torch, no Megatron here)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_RNG = f"{__package__}.core"
# Unpatched: the round trip completes and EP rank 1 restores EP rank 0's RNG states.
SCENARIOS = (
    Scenario(
        ID,
        "ep2_round_trip",
        f"{_RNG}:ep2_round_trip",
        2,
        Bug.wrong_values(),
        prepare=f"{_RNG}:prepare",
        timeout=180,
        requires=("megatron.training.checkpointing:get_rng_state",),
        doc="Megatron's save_checkpoint / load_checkpoint, torch_dist, EP=2 GPTModel: every rank's RNG states",
    ),
)

# fsdp_dtensor (Megatron-FSDP users' format), run by the tests (tests/fixes/test_rng_under_ep.py),
# not registered for selftest: the source diffs (patches/rng-under-ep) cover torch_dist only, and
# tests/patches round-trips every registered scenario with the monkeypatch off on the patched source.
# Unpatched both ranks restore a mix of the two ranks' states (DCP keeps one copy of each leaf).
FSDP_DTENSOR = f"{_RNG}:ep2_fsdp_dtensor"
