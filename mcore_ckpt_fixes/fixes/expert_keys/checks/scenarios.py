"""expert-keys' round trips, as ``selftest`` and the tests find them (nothing heavy imported).

Unpatched, the round trip completes and the EP-rank-0 ranks load EP rank 1's expert biases (model
and Adam state); the tests pin exactly which rank's values each rank gets.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario

_RT = "mcore_ckpt_fixes.fixes.expert_keys.checks.core"
_REQUIRES = ("megatron.core.transformer.fsdp_dtensor_checkpoint:handle_experts_in_state_dict",)
# Single grouped expert tensors (one tensor of all local experts per GEMM) exist from 0.18.
_GROUPED_REQUIRES = _REQUIRES + (
    "megatron.core.transformer.transformer_config:TransformerConfig.moe_single_grouped_bias",
)
# Unpatched, a grouped weight stops the optimizer's parameter naming (handle_experts_in_state_dict);
# a grouped bias beside indexed weights is written by both EP ranks under one key: wrong values.
GROUPED_BUG = Bug.raises(
    "setup",
    "AssertionError: Failed to parse expert index from key: module.module.decoder.layers.0.mlp.experts.linear_fc1.weight",
)

SCENARIOS = (
    Scenario(
        "expert-keys",
        "ep2",
        f"{_RT}:ep2",
        2,
        Bug.wrong_values(),
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=180,
        requires=_REQUIRES,
        doc="EP=2, 4 TE grouped experts (weight{i}/bias{i}) as Megatron-FSDP DTensors + Adam state, fsdp_dtensor preprocessing, DCP",
    ),
    Scenario(
        "expert-keys",
        "ep2_dp2",
        f"{_RT}:ep2_dp2",
        4,
        Bug.wrong_values(),
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=240,
        requires=_REQUIRES,
        doc="the same with EP=2 x expert-DP=2 on 4 ranks (uneven FSDP shards, one empty)",
    ),
    Scenario(
        "expert-keys",
        "ep2_grouped",
        f"{_RT}:ep2_grouped",
        2,
        GROUPED_BUG,
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=180,
        requires=_GROUPED_REQUIRES,
        doc="EP=2, single grouped expert weights and biases (moe_single_grouped_weight/_bias) + Adam state, DCP",
    ),
    Scenario(
        "expert-keys",
        "ep2_grouped_bias",
        f"{_RT}:ep2_grouped_bias",
        2,
        Bug.wrong_values(),
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=180,
        requires=_GROUPED_REQUIRES,
        doc="EP=2, indexed expert weights beside single grouped biases (moe_single_grouped_bias) + Adam state, DCP",
    ),
    Scenario(
        "expert-keys",
        "ep2_dp2_grouped",
        f"{_RT}:ep2_dp2_grouped",
        4,
        GROUPED_BUG,
        prepare=f"{_RT}:prepare",
        devices=("cpu",),
        timeout=240,
        requires=_GROUPED_REQUIRES,
        doc="single grouped expert tensors with EP=2 x expert-DP=2 on 4 ranks (uneven FSDP shards, one empty)",
    ),
)
