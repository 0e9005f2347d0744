"""dtensor-placement's round trips, as selftest and the tests find them (light: no torch).

Unpatched (0.16-0.19 alike). moe_ep: the expert shards get dense-DP offsets (4 chunks where expert
DP has 2) and SequentialMLP makes expert-DP rank 1 a non-main replica, so Megatron's validation
rejects every expert tensor; the router (its mesh is the dense DP group) is fine. hsdp: saves and
round-trips in its own layout, silently writing 4 chunks of a 2-chunk tensor (global shape
doubled); any other layout (here: the unsharded layer) then fails.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_DTP = f"{__package__}.core"
_DTP_EXPERT_KEYS = ", ".join(f"experts.experts.linear_fc{i}.{p}" for i in (1, 2) for p in ("bias", "weight"))
# 0.12.1-0.14 MoE layers have no biases ("Bias is not supported for MoE"): the weights only.
_DTP_EXPERT_WEIGHTS = ", ".join(f"experts.experts.linear_fc{i}.weight" for i in (1, 2))
DTP_TP_FSDP = f"{_DTP}:tp_fsdp"  # world 2, TP=2 + FSDP2: upstream handles it; exact both ways (tests only)
SCENARIOS = (
    Scenario(
        ID,
        "moe_ep",
        f"{_DTP}:moe_ep",
        4,
        {
            "<0.12.1": Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_KEYS}"),
            ">=0.12.1,<0.15": Bug.raises(
                "validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_WEIGHTS}"
            ),
            ">=0.15": Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_KEYS}"),
        },
        prepare=f"{_DTP}:prepare",
        devices=("cpu",),
        timeout=180,
        doc="MoELayer, SequentialMLP experts FSDP2 over expert DP (EP=2, DP=4, expert DP=2), router over dense DP",
    ),
    Scenario(
        ID,
        "hsdp",
        f"{_DTP}:hsdp",
        4,
        Bug.raises(
            "load_unsharded",
            "CheckpointingException: Global shape mismatch for loaded (torch.Size([24, 8])) and expected "
            "((12, 8)) tensor for key linear_fc1.weight",
        ),
        prepare=f"{_DTP}:prepare",
        devices=("cpu",),
        timeout=180,
        doc="dense MLP under HSDP (2 replicate x 2 shard), loaded back in place and into the unsharded layer",
    ),
)
# ep2_helpers, unpatched: dense-DP offsets (global (2, 8, 3), rank 1 at (1, 4, 0)) for every case;
# with the placement half of the fix only, rank 1 was a non-main replica (dense DP rank 1), so
# expert 1 had no writer: the same validation error.
_DTP_HELPER_KEYS = ", ".join(
    sorted(
        (
            "expert_make_sharded_replicate",
            "expert_make_sharded_shard0",
            "expert_make_tp_sharded_replicate",
            "expert_make_tp_sharded_shard0",
        )
    )
)
SCENARIOS += (
    Scenario(
        ID,
        "ep2_helpers",
        f"{_DTP}:ep2_helpers",
        2,
        Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_HELPER_KEYS}"),
        prepare=f"{_DTP}:prepare",
        devices=("cpu",),
        timeout=150,
        doc="EP=2 on 2 ranks (expert DP 1): expert DTensors Shard(0)/Replicate on the size-1 expert-DP mesh, "
        "both helpers called with the dense DP group",
    ),
)
