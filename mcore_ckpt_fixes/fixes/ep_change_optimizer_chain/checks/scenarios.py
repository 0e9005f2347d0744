"""ep-change-optimizer-chain's round trip as the suite and ``selftest`` find it (nothing heavy
imported here): a MoE GPT saved under EP=2, resumed under EP=1 and saved, resumed under EP=2 again,
through ``megatron.training``'s save_checkpoint and load_checkpoint (checks/core.py)."""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The release's load of the EP=2 checkpoint under EP=1 (one optimizer where two were saved).
EP2_TO_EP1 = "KeyError: 'optimizer'"
# And of an EP=1 checkpoint under EP=2 (docs/resume.md): not reached by the round trip when the first load stops.
EP1_TO_EP2 = "RuntimeError: Expected 2 entries in state dict, but got 4."

SCENARIOS = (
    Scenario(
        ID,
        "ep2_to_ep1_and_back",
        f"{_CORE}:round_trip",
        2,
        {">=0.17.0,<=0.19.2": Bug.raises("load", EP2_TO_EP1)},
        prepare=f"{_CORE}:prepare",
        timeout=240.0,
        requires=("megatron.training.checkpointing:load_checkpoint",),
        doc="a MoE GPT's fully_reshardable checkpoint saved under EP=2, loaded under EP=1 and saved, loaded under "
        "EP=2 again: every tensor (parameters, main parameters, Adam moments) the same bits as full tensors, the "
        "scheduler and iteration the same, and a step trained after each load",
    ),
)
