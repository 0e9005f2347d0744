"""tp-group's round trips, as the test suite and ``selftest`` run them (nothing heavy imported here).

The fix-off half stops in ``sharded_state_dict`` with the first assertion each model hits without
the fix, exactly. A lone MambaMixer differs: with parallel_state uninitialised its group-less helper
call passes tp_group=None through and the dp-cp lookup asserts first; in a stack (and in RADIO)
MegatronModule's sharded_state_dict asks parallel_state for the TP group before that.
"""

from ....testing.registry import Bug, Scenario

_RT = f"{__package__}.core"
TP_GROUP_NOT_INIT = "AssertionError: tensor model parallel group is not initialized"
DP_CP_NOT_INIT = "AssertionError: data parallel group with context parallel combined is not initialized"
# 0.12-0.15 models take no ProcessGroupCollection: nothing to build with explicit groups there.
_APPLICABLE = f"{_RT}:explicit_group_checkpointing"

SCENARIOS = (
    Scenario(
        "tp-group",
        "mamba_stack",
        f"{_RT}:mamba_stack",
        2,
        Bug.raises("sharded_state_dict", TP_GROUP_NOT_INIT),
        prepare=f"{_RT}:prepare",
        batch=f"{_RT}:cases",
        applicable=_APPLICABLE,
        doc="two-layer MambaStack built from a ProcessGroupCollection (TP=2, no parallel_state)",
    ),
    Scenario(
        "tp-group",
        "mamba_mixer",
        f"{_RT}:mamba_mixer",
        2,
        Bug.raises("sharded_state_dict", DP_CP_NOT_INIT),
        prepare=f"{_RT}:prepare",
        batch=f"{_RT}:cases",
        applicable=_APPLICABLE,
        doc="a lone MambaMixer with its gated RMSNorm (TP=2, no parallel_state)",
    ),
    Scenario(
        "tp-group",
        "radio_vit",
        f"{_RT}:radio_vit",
        2,
        Bug.raises("sharded_state_dict", TP_GROUP_NOT_INIT),
        prepare=f"{_RT}:prepare",
        batch=f"{_RT}:cases",
        applicable=_APPLICABLE,
        doc="a small RADIOViTModel (TP=2, no parallel_state)",
    ),
)
