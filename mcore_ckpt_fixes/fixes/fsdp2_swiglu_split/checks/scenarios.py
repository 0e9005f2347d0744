"""fsdp2-swiglu-split's round trip as the suite and ``selftest`` find it (no torch, no Megatron here).

A SwiGLU MLP under Megatron's TorchFullyShardedDataParallel (torch FSDP2), TP=1, DP=2, with
FP32Optimizer state; saved, then loaded in its own layout and unsharded (see checks/core.py).
Unpatched (0.12.0-0.18.x) the own-layout load is exact and the unsharded one finds W's second half
and V's first half swapped, in the weight, the bias and both Adam moments.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
_FC1 = ("linear_fc1.bias", "linear_fc1.weight")
_WRONG = ", ".join(f"unsharded/{p}{k}" for p in ("", "exp_avg/", "exp_avg_sq/") for k in _FC1)
SCRAMBLED = Bug.raises(
    "load_unsharded",
    f"SwiGLU rows out of place, loaded unsharded: {', '.join(sorted(_WRONG.split(', ')))}; "
    "linear_fc1.weight holds saved rows 0-5, 12-17, 6-11, 18-23",
)

SCENARIOS = (
    Scenario(
        ID,
        "fsdp2_mlp",
        f"{_CORE}:fsdp2_mlp",
        2,
        {">=0.12.0,<0.19.0": SCRAMBLED},
        prepare=f"{_CORE}:prepare",
        devices=("cpu",),
        timeout=180,
        doc="SwiGLU MLP under Megatron's TorchFullyShardedDataParallel (DP=2) with FP32Optimizer state: "
        "saved, loaded in place and unsharded",
    ),
)
