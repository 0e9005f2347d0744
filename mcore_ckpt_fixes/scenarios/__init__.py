"""Scenarios of the fixes not yet moved into their own package (``fixes/<fix>/scenarios.py``).

Transitional: :func:`mcore_ckpt_fixes.testing.all_scenarios` reads this list for a fix whose
package declares none. Nothing heavy is imported here.
"""

from __future__ import annotations

from ..testing.registry import Bug, Scenario, for_fix, resolve  # noqa: F401  (re-exported while fixes move)

__all__ = ["Bug", "Scenario", "SCENARIOS", "for_fix", "resolve"]


_TP = "mcore_ckpt_fixes.scenarios.tp_group"

# tp-group: the first assertion each model hits without the fix, exactly. A lone MambaMixer
# differs: with parallel_state uninitialised its group-less helper call passes tp_group=None
# through and the dp-cp lookup asserts first; in a stack (and in RADIO) MegatronModule's
# sharded_state_dict asks parallel_state for the TP group before that.
_TP_GROUP_NOT_INIT = "AssertionError: tensor model parallel group is not initialized"
_DP_CP_NOT_INIT = "AssertionError: data parallel group with context parallel combined is not initialized"

_TP_APPLICABLE = f"{_TP}:explicit_group_checkpointing"
SCENARIOS = (
    Scenario(
        "tp-group", "mamba_stack", f"{_TP}:mamba_stack", 2,
        Bug.raises("sharded_state_dict", _TP_GROUP_NOT_INIT),
        prepare=f"{_TP}:prepare", applicable=_TP_APPLICABLE,
        doc="two-layer MambaStack built from a ProcessGroupCollection (TP=2, no parallel_state)",
    ),
    Scenario(
        "tp-group", "mamba_mixer", f"{_TP}:mamba_mixer", 2,
        Bug.raises("sharded_state_dict", _DP_CP_NOT_INIT),
        prepare=f"{_TP}:prepare", applicable=_TP_APPLICABLE,
        doc="a lone MambaMixer with its gated RMSNorm (TP=2, no parallel_state)",
    ),
    Scenario(
        "tp-group", "radio_vit", f"{_TP}:radio_vit", 2,
        Bug.raises("sharded_state_dict", _TP_GROUP_NOT_INIT),
        prepare=f"{_TP}:prepare", applicable=_TP_APPLICABLE,
        doc="a small RADIOViTModel (TP=2, no parallel_state)",
    ),
)


_GDN = "mcore_ckpt_fixes.scenarios.gdn_fsdp_split"
# gdn-fsdp-split, unpatched: 0.18 applies the TP split twice and the save stops in
# validate_uneven_dtensor; 0.19's fast path saves the TP-local pieces as if TP-global, so the TP
# ranks write colliding chunks and load each other's values.
_GDN_REQUIRES = ("megatron.core.transformer.fsdp_dtensor_checkpoint:handle_gdn_in_state_dict",)
_GDN_TP_LOCAL_BUG = {
    "<0.19": Bug.raises("preprocess", "AssertionError: [Megatron-FSDP] DTensor chunk metadata boundary check failed."),
    ">=0.19": Bug.wrong_values(),
}

SCENARIOS += (
    Scenario(
        "gdn-fsdp-split", "tp2_local", f"{_GDN}:tp2_local", 2, _GDN_TP_LOCAL_BUG,
        prepare=f"{_GDN}:prepare", devices=("cpu",), timeout=120, requires=_GDN_REQUIRES,
        doc="GDN in_proj/conv1d as TP-local Megatron-FSDP DTensors (TP=2, uneven FSDP shards), DCP save/load",
    ),
    Scenario(
        "gdn-fsdp-split", "tp2_local_optimizer", f"{_GDN}:tp2_local_optimizer", 2, _GDN_TP_LOCAL_BUG,
        prepare=f"{_GDN}:prepare", devices=("cpu",), timeout=120, requires=_GDN_REQUIRES,
        doc="the same with Adam exp_avg/exp_avg_sq state",
    ),
)
# Plain torch DTensors (distribute_tensor / DTensor.from_local, no Megatron-FSDP attributes), as a
# conversion script hands them over. 0.18 reads Megatron-FSDP's slice off every parameter and stops;
# 0.19 splits TP=1 tensors right (exact with the fix off too) and, at TP=2, writes both TP ranks'
# TP-local pieces to the same chunks.
_GDN_NO_FSDP_SLICE = Bug.raises("preprocess", "AttributeError: 'DTensor' object has no attribute 'megatron_fsdp_slice'")
SCENARIOS += (
    Scenario(
        "gdn-fsdp-split", "plain_dtensors", f"{_GDN}:plain_dtensors", 2, {"<0.19": _GDN_NO_FSDP_SLICE},
        prepare=f"{_GDN}:prepare", devices=("cpu",), timeout=150, requires=_GDN_REQUIRES,
        doc="TP=1 GDN tensors as plain torch DTensors: Shard(0) on 1-D and 2-D meshes, nested Shard(0), Replicate; + Adam state",
    ),
    Scenario(
        "gdn-fsdp-split", "plain_dtensors_tp2", f"{_GDN}:plain_dtensors_tp2", 2,
        {"<0.19": _GDN_NO_FSDP_SLICE, ">=0.19": Bug.wrong_values()},
        prepare=f"{_GDN}:prepare", devices=("cpu",), timeout=120, requires=_GDN_REQUIRES,
        doc="TP=2, TP-local plain torch DTensors on a (dp, tp) mesh + Adam state",
    ),
)


_RNG = "mcore_ckpt_fixes.scenarios.rng_under_ep"
# rng-under-ep, unpatched: the round trip completes and EP rank 1 restores EP rank 0's RNG states.
SCENARIOS += (
    Scenario(
        "rng-under-ep", "ep2_round_trip", f"{_RNG}:ep2_round_trip", 2, Bug.wrong_values(),
        prepare=f"{_RNG}:prepare", timeout=180, requires=("megatron.training.checkpointing:get_rng_state",),
        doc="Megatron's save_checkpoint / load_checkpoint, torch_dist, EP=2 GPTModel: every rank's RNG states",
    ),
)


_MIMO = "mcore_ckpt_fixes.scenarios.mimo_optimizer"


def _mimo_collision(idxs):
    """Megatron's save-time validation error when two modules' DistributedOptimizers both name
    their objects ``optimizer.distributed.dp_group_idx_<mp rank>...`` (defect (d))."""
    errors = []
    for i in idxs:
        for what in ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded"):
            errors.append(f"Duplicate ShardedObject keys: ['optimizer.distributed.dp_group_idx_{i}.{what}/shard_0_1']")
            errors.append("Invalid access pattern: -1 ShardedObject are missing.")
    return "CheckpointingException: Invalid sharding pattern validation. Errors: " + "\n".join(errors)


# mimo-optimizer: non-colocated MimoOptimizer over DistributedOptimizers (dp_reshardable: the only
# sharding type that round-trips on CPU, see scenarios/mimo_optimizer.py). Registered: world 2
# (selftest runs 2 ranks by default). The world-4 TP=2 variant (same function, 4 ranks,
# MIMO_WORLD4_BUG) is run by tests/fixes/test_mimo_optimizer.py.
_MIMO_REQUIRES = ("megatron.core.models.mimo.optimizer:MimoOptimizer",)
# On 0.19 the fix is the load side only (reading what unfixed 0.17/0.18 wrote): this round trip is
# exact there with the fix off (tests/fixes/test_mimo_matrix.py covers the old-layout loads).
MIMO_SAVE_SIDE = ">=0.17.0,<0.19.0"
MIMO_WORLD2_BUG = Bug.raises("save", _mimo_collision([0]))
MIMO_WORLD4_BUG = Bug.raises("save", _mimo_collision([0, 1]))
SCENARIOS += (
    Scenario(
        "mimo-optimizer", "world2", f"{_MIMO}:round_trip", 2,
        {MIMO_SAVE_SIDE: MIMO_WORLD2_BUG},
        prepare=f"{_MIMO}:prepare", devices=("cpu",), requires=_MIMO_REQUIRES,
        doc="language on rank 0, vision on rank 1, DistributedOptimizer dp_reshardable",
    ),
)

_DTP = "mcore_ckpt_fixes.scenarios.dtensor_placement"
# dtensor-placement, unpatched (0.16-0.19 alike). moe_ep: the expert shards get dense-DP offsets
# (4 chunks where expert DP has 2) and SequentialMLP makes expert-DP rank 1 a non-main replica, so
# Megatron's validation rejects every expert tensor; the router (its mesh is the dense DP group)
# is fine. hsdp: saves and round-trips in its own layout, silently writing 4 chunks of a
# 2-chunk tensor (global shape doubled); any other layout (here: the unsharded layer) then fails.
_DTP_EXPERT_KEYS = ", ".join(f"experts.experts.linear_fc{i}.{p}" for i in (1, 2) for p in ("bias", "weight"))
# 0.12.1-0.14 MoE layers have no biases ("Bias is not supported for MoE"): the weights only.
_DTP_EXPERT_WEIGHTS = ", ".join(f"experts.experts.linear_fc{i}.weight" for i in (1, 2))
DTP_TP_FSDP = f"{_DTP}:tp_fsdp"  # world 2, TP=2 + FSDP2: upstream handles it; exact both ways (tests only)
SCENARIOS += (
    Scenario(
        "dtensor-placement", "moe_ep", f"{_DTP}:moe_ep", 4,
        {
            "<0.12.1": Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_KEYS}"),
            ">=0.12.1,<0.15": Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_WEIGHTS}"),
            ">=0.15": Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_EXPERT_KEYS}"),
        },
        prepare=f"{_DTP}:prepare", devices=("cpu",), timeout=180,
        doc="MoELayer, SequentialMLP experts FSDP2 over expert DP (EP=2, DP=4, expert DP=2), router over dense DP",
    ),
    Scenario(
        "dtensor-placement", "hsdp", f"{_DTP}:hsdp", 4,
        Bug.raises(
            "load_unsharded",
            "CheckpointingException: Global shape mismatch for loaded (torch.Size([24, 8])) and expected "
            "((12, 8)) tensor for key linear_fc1.weight",
        ),
        prepare=f"{_DTP}:prepare", devices=("cpu",), timeout=180,
        doc="dense MLP under HSDP (2 replicate x 2 shard), loaded back in place and into the unsharded layer",
    ),
)
# ep2_helpers, unpatched: dense-DP offsets (global (2, 8, 3), rank 1 at (1, 4, 0)) for every case;
# with the placement half of the fix only, rank 1 was a non-main replica (dense DP rank 1), so
# expert 1 had no writer: the same validation error.
_DTP_HELPER_KEYS = ", ".join(sorted(("expert_make_sharded_replicate", "expert_make_sharded_shard0",
                                     "expert_make_tp_sharded_replicate", "expert_make_tp_sharded_shard0")))
SCENARIOS += (
    Scenario(
        "dtensor-placement", "ep2_helpers", f"{_DTP}:ep2_helpers", 2,
        Bug.raises("validate", f"CheckpointingException: Invalid access pattern for {_DTP_HELPER_KEYS}"),
        prepare=f"{_DTP}:prepare", devices=("cpu",), timeout=150,
        doc="EP=2 on 2 ranks (expert DP 1): expert DTensors Shard(0)/Replicate on the size-1 expert-DP mesh, "
            "both helpers called with the dense DP group",
    ),
)


_EK = "mcore_ckpt_fixes.scenarios.expert_keys"
_EK_REQUIRES = ("megatron.core.transformer.fsdp_dtensor_checkpoint:handle_experts_in_state_dict",)
# expert-keys, unpatched: the round trip completes and the EP-rank-0 ranks load EP rank 1's expert
# biases (model and Adam state); the tests pin exactly which rank's values each rank gets.
SCENARIOS += (
    Scenario(
        "expert-keys", "ep2", f"{_EK}:ep2", 2, Bug.wrong_values(),
        prepare=f"{_EK}:prepare", devices=("cpu",), timeout=180, requires=_EK_REQUIRES,
        doc="EP=2, 4 TE grouped experts (weight{i}/bias{i}) as Megatron-FSDP DTensors + Adam state, fsdp_dtensor preprocessing, DCP",
    ),
    Scenario(
        "expert-keys", "ep2_dp2", f"{_EK}:ep2_dp2", 4, Bug.wrong_values(),
        prepare=f"{_EK}:prepare", devices=("cpu",), timeout=240, requires=_EK_REQUIRES,
        doc="the same with EP=2 x expert-DP=2 on 4 ranks (uneven FSDP shards, one empty)",
    ),
)
# Single grouped expert tensors (one tensor of all local experts per GEMM) exist from 0.18.
_EK_GROUPED_REQUIRES = _EK_REQUIRES + ("megatron.core.transformer.transformer_config:TransformerConfig.moe_single_grouped_bias",)
# Unpatched, a grouped weight stops the optimizer's parameter naming (handle_experts_in_state_dict);
# a grouped bias beside indexed weights is written by both EP ranks under one key: wrong values.
_EK_GROUPED_BUG = Bug.raises(
    "setup", "AssertionError: Failed to parse expert index from key: module.module.decoder.layers.0.mlp.experts.linear_fc1.weight"
)
SCENARIOS += (
    Scenario(
        "expert-keys", "ep2_grouped", f"{_EK}:ep2_grouped", 2, _EK_GROUPED_BUG,
        prepare=f"{_EK}:prepare", devices=("cpu",), timeout=180, requires=_EK_GROUPED_REQUIRES,
        doc="EP=2, single grouped expert weights and biases (moe_single_grouped_weight/_bias) + Adam state, DCP",
    ),
    Scenario(
        "expert-keys", "ep2_grouped_bias", f"{_EK}:ep2_grouped_bias", 2, Bug.wrong_values(),
        prepare=f"{_EK}:prepare", devices=("cpu",), timeout=180, requires=_EK_GROUPED_REQUIRES,
        doc="EP=2, indexed expert weights beside single grouped biases (moe_single_grouped_bias) + Adam state, DCP",
    ),
    Scenario(
        "expert-keys", "ep2_dp2_grouped", f"{_EK}:ep2_dp2_grouped", 4, _EK_GROUPED_BUG,
        prepare=f"{_EK}:prepare", devices=("cpu",), timeout=240, requires=_EK_GROUPED_REQUIRES,
        doc="single grouped expert tensors with EP=2 x expert-DP=2 on 4 ranks (uneven FSDP shards, one empty)",
    ),
)

_HG = "mcore_ckpt_fixes.scenarios.hsdp_ep_guard"
# hsdp-ep-guard is a guard: with it, HSDP x EP=2 is refused at set-up with the guard's one line
# (the scenario accepts exactly that line as the outcome) and the other configurations round-trip;
# without it, 0.16 places the experts on the dense mesh, which the scenario reports as below.
SCENARIOS += (
    Scenario(
        "hsdp-ep-guard", "configurations", f"{_HG}:configurations", 4,
        Bug.raises(
            "placement",
            "AssertionError: hsdp_ep2: expert parameters are sharded on the dense data-parallel mesh, "
            "not over their expert-data-parallel ranks",
        ),
        prepare=f"{_HG}:prepare", devices=("cpu",), timeout=240,
        requires=("megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel",),
        applicable=f"{_HG}:expert_meshes_exist",
        doc="Megatron-FSDP meshes for EP=2, HSDP, HSDP x EP=2 on 4 ranks; DCP round trip on each accepted one",
    ),
)
