"""gdn-fsdp-split's round trips, as ``selftest`` and the tests find them (nothing heavy imported).

Unpatched, 0.18 applies the TP split twice and the save stops in validate_uneven_dtensor; 0.19's
fast path saves the TP-local pieces as if TP-global, so the TP ranks write colliding chunks and load
each other's values.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario

_RT = "mcore_ckpt_fixes.fixes.gdn_fsdp_split.checks.core"
_REQUIRES = ("megatron.core.transformer.fsdp_dtensor_checkpoint:handle_gdn_in_state_dict",)
TP_LOCAL_BUG = {
    "<0.19": Bug.raises("preprocess", "AssertionError: [Megatron-FSDP] DTensor chunk metadata boundary check failed."),
    ">=0.19": Bug.wrong_values(),
}
# Plain torch DTensors (distribute_tensor / DTensor.from_local, no Megatron-FSDP attributes), as a
# conversion script hands them over. 0.18 reads Megatron-FSDP's slice off every parameter and stops;
# 0.19 splits TP=1 tensors right (exact with the fix off too) and, at TP=2, writes both TP ranks'
# TP-local pieces to the same chunks.
NO_FSDP_SLICE = Bug.raises("preprocess", "AttributeError: 'DTensor' object has no attribute 'megatron_fsdp_slice'")

SCENARIOS = (
    Scenario(
        "gdn-fsdp-split",
        "tp2_local",
        f"{_RT}:tp2_local",
        2,
        TP_LOCAL_BUG,
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=120,
        requires=_REQUIRES,
        doc="GDN in_proj/conv1d as TP-local Megatron-FSDP DTensors (TP=2, uneven FSDP shards), DCP save/load",
    ),
    Scenario(
        "gdn-fsdp-split",
        "tp2_local_optimizer",
        f"{_RT}:tp2_local_optimizer",
        2,
        TP_LOCAL_BUG,
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=120,
        requires=_REQUIRES,
        doc="the same with Adam exp_avg/exp_avg_sq state",
    ),
    Scenario(
        "gdn-fsdp-split",
        "plain_dtensors",
        f"{_RT}:plain_dtensors",
        2,
        {"<0.19": NO_FSDP_SLICE},
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=150,
        requires=_REQUIRES,
        doc="TP=1 GDN tensors as plain torch DTensors: Shard(0) on 1-D and 2-D meshes, nested Shard(0), Replicate; + Adam state",
    ),
    Scenario(
        "gdn-fsdp-split",
        "plain_dtensors_tp2",
        f"{_RT}:plain_dtensors_tp2",
        2,
        {"<0.19": NO_FSDP_SLICE, ">=0.19": Bug.wrong_values()},
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=120,
        requires=_REQUIRES,
        doc="TP=2, TP-local plain torch DTensors on a (dp, tp) mesh + Adam state",
    ),
)
