"""The configurations the resume check trains, stops and resumes.

Each is a small GPT trained through Megatron's own model, DDP, distributed optimizer, scheduler and
``megatron.training.checkpointing`` (:mod:`.job`), unless ``job`` names another (the MIMO model's,
Megatron-Bridge's, verl's and ms-swift's save and load). ``needs`` names the fixes without which the
configuration cannot resume exactly on a release those fixes apply to: the check asserts that the
fixes-off run diverges exactly there, and only there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..fixes.mimo_optimizer.checks.scenarios import MIMO_SAVE_SIDE


@dataclass(frozen=True)
class Config:
    name: str
    summary: str
    world: int
    tp: int = 1
    ep: int = 0  # expert-parallel size (0: a dense model)
    etp: int = 0  # expert-tensor-parallel size (0: Megatron's default, the TP size)
    distributed_optimizer: bool = True
    optim_format: str = "dp_reshardable"  # how the distributed optimizer's state is saved
    # DDP's bucket size (elements) with overlap_grad_reduce, as --overlap-grad-reduce --ddp-bucket-size
    # (several buckets per gradient buffer); None: one bucket, no overlap.
    ddp_bucket_size: Optional[int] = None
    # Megatron-LM's --decoupled-lr (the embedding and output layer's own learning rate), or None.
    decoupled_lr: Optional[float] = None
    fused_adam: bool = True  # Megatron's GPU optimizer path (Apex FusedAdam's interface)
    # How the distributed optimizer's checkpoint requests are built: "megatron" as
    # megatron.training's save_checkpoint / load_checkpoint build them (is_loading, metadata); as
    # third-party trainers build them: "without-is-loading" (metadata passed on, is_loading never)
    # or "bare" (sharded_state_dict(model_sd), neither).
    optimizer_requests: str = "megatron"
    ckpt_format: str = "torch_dist"
    # Megatron-LM's --dist-ckpt-strictness ("" its default, assume_ok_unexpected) and --rerun-mode
    # ("": no rerun state machine set up, as a script that never calls initialize_megatron; Megatron-LM's
    # own default is validate_results, set up as initialize_megatron does).
    strictness: str = ""
    rerun_mode: str = ""
    # More of Megatron-LM's checkpoint options, as given on its command line (save and resume alike).
    extra_args: Tuple[str, ...] = ()
    needs: Tuple[str, ...] = ()
    # Releases (a specifier) on which ``needs`` is what the fixes-off run shows; empty: wherever
    # the fix applies. A fix may apply to a release for a defect this configuration does not reach.
    needs_releases: str = ""
    job: str = "mcore_ckpt_fixes.resume.job:run"  # one rank of one run
    requires: str = ""  # a module the release must have, else the configuration is not applicable

    @property
    def dp(self) -> int:
        return self.world // self.tp


CONFIGS = (
    Config("dense-tp2", "dense GPT, TP=2, distributed optimizer (dp_reshardable)", world=2, tp=2),
    Config(
        "moe-ep2",
        "MoE GPT, EP=2 on 2 ranks, distributed optimizer (dp_reshardable)",
        world=2,
        ep=2,
        needs=("rng-under-ep",),
    ),
    Config(
        "moe-ep2-fully-reshardable",
        "MoE GPT, EP=2, distributed optimizer (fully_reshardable)",
        world=2,
        ep=2,
        optim_format="fully_reshardable",
        needs=("rng-under-ep",),
    ),
    Config(
        "moe-ep2-dp2",
        "MoE GPT, EP=2 x DP=2 on 4 ranks, distributed optimizer (dp_reshardable)",
        world=4,
        ep=2,
        needs=("rng-under-ep",),
    ),
    Config(
        "mimo-noncolocated",
        "non-colocated MIMO (language model on rank 0, vision encoder on rank 1), MimoOptimizer over "
        "distributed optimizers (dp_reshardable), saved with dist_checkpointing",
        world=2,
        # From 0.19 upstream writes this layout itself; what mimo-optimizer still fixes there (a
        # non-distributed optimizer's common state) a distributed optimizer does not have.
        needs=("mimo-optimizer",),
        needs_releases=MIMO_SAVE_SIDE,
        job="mcore_ckpt_fixes.resume.mimo:run",
        requires="megatron.core.models.mimo.optimizer",
    ),
    Config(
        "moe-ep2-torch-adam",
        "MoE GPT, EP=2, distributed optimizer on torch's Adam (no Apex or Transformer Engine installed)",
        world=2,
        ep=2,
        fused_adam=False,
        needs=("torch-adam-step", "rng-under-ep"),
    ),
    Config(
        "moe-tp2-etp1-legacy",
        "MoE GPT, TP=2 with EP=1 and expert TP=1 on 2 ranks (sequence parallel), saved in the legacy "
        "torch format (mp_rank_* files)",
        world=2,
        tp=2,
        ep=1,
        etp=1,
        ckpt_format="torch",
        needs=("legacy-save-writers",),
    ),
    Config(
        "dense-dp2-load-without-is-loading",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable) whose load request is built without "
        "is_loading, as third-party trainers have built it",
        world=2,
        optimizer_requests="without-is-loading",
        needs=("dist-optim-state",),
    ),
    Config(
        "dense-dp2-bare-requests",
        "dense GPT, DP=2, distributed optimizer whose save and load requests are "
        "sharded_state_dict(model_sd): no is_loading, no metadata",
        world=2,
        optimizer_requests="bare",
        needs=("dist-optim-state",),
    ),
    Config(
        "dense-dp2-fully-reshardable-buckets",
        "dense GPT, DP=2, overlap_grad_reduce with several buckets per gradient buffer, distributed "
        "optimizer (fully_reshardable)",
        world=2,
        optim_format="fully_reshardable",
        ddp_bucket_size=1000,
        needs=("fully-reshardable-buckets",),
    ),
    Config(
        "dense-dp2-decoupled-lr",
        "dense GPT, DP=2, --decoupled-lr (the embedding and output layer's own learning rate), "
        "distributed optimizer (dp_reshardable)",
        world=2,
        decoupled_lr=0.03,
        needs=("param-group-identity",),
    ),
    Config(
        "dense-dp2-strict-validate-results",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --rerun-mode validate_results (Megatron-LM's "
        "default) and --dist-ckpt-strictness raise_all",
        world=2,
        strictness="raise_all",
        rerun_mode="validate_results",
        # 0.18+ writes the machine's idle entry at every save; on 0.17 only rerun-state-constant-structure
        # does, so there the release alone resumes exactly.
        needs=("rerun-state-strict-load",),
        needs_releases=">=0.18",
    ),
    Config(
        "dense-dp2-override-scheduler",
        "dense GPT, DP=2, --decoupled-lr, --override-opt-param-scheduler, distributed optimizer (dp_reshardable): "
        "the same schedule on resume (a changed one is scheduler-override-group-lr's round trip)",
        world=2,
        decoupled_lr=0.03,
        extra_args=("--override-opt-param-scheduler",),
        # Up to 0.18 the decoupled group loads the other group's saved state without the fix (the
        # override does not change that: the groups come back before the scheduler).
        needs=("param-group-identity",),
    ),
    Config(
        "dense-dp2-fully-parallel-load",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --ckpt-fully-parallel-load",
        world=2,
        extra_args=("--ckpt-fully-parallel-load",),
    ),
    Config(
        "dense-dp2-no-fully-parallel-save",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --no-ckpt-fully-parallel-save",
        world=2,
        extra_args=("--no-ckpt-fully-parallel-save",),
    ),
    Config(
        "dense-dp2-constant-structure",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --ckpt-assume-constant-structure",
        world=2,
        extra_args=("--ckpt-assume-constant-structure",),
    ),
    Config(
        "moe-ep2-bridge",
        "MoE GPT, EP=2, distributed optimizer (dp_reshardable), saved and loaded with Megatron-Bridge's "
        "save_checkpoint / load_checkpoint",
        world=2,
        ep=2,
        job="mcore_ckpt_fixes.resume.bridge:run",
        requires="megatron.bridge.training.checkpointing",
    ),
    Config(
        "moe-ep2-verl",
        "MoE GPT, EP=2, distributed optimizer (dp_reshardable), saved and loaded with verl's MegatronCheckpointManager",
        world=2,
        ep=2,
        needs=("rng-under-ep",),
        job="mcore_ckpt_fixes.resume.verl:run",
        requires="verl.utils.checkpoint.megatron_checkpoint_manager",
    ),
    Config(
        "moe-ep2-ms-swift",
        "MoE GPT, EP=2, distributed optimizer (dp_reshardable), saved and loaded with ms-swift's "
        "save_mcore_checkpoint / load_mcore_checkpoint",
        world=2,
        ep=2,
        needs=("rng-under-ep",),
        job="mcore_ckpt_fixes.resume.ms_swift:run",
        requires="swift.megatron.utils.megatron_lm_utils",
    ),
)

# Configurations that do not resume on the releases the check covers, for a catalogued reason no
# fix here covers yet: run by the tests (the failure must still be the catalogued one), listed by
# ``selftest --resume`` apart from the pass/fail verdict. None at present.
KNOWN_FAILING: Tuple[Config, ...] = ()
KNOWN_BUG: dict = {}

# Not trained by the check, with the reason (a configuration a release cannot build or save is
# never counted as a pass).
NOT_RUN = {
    "fully_sharded_model_space": "megatron.training saves the distributed optimizer as dp_reshardable or "
    "fully_reshardable only, and from 0.16.0 no release can describe fully_sharded_model_space "
    "(ShardedTensor.flattened_range is rejected); a call without metadata, which asks for it, gets "
    "dp_reshardable with dist-optim-state (configuration dense-dp2-bare-requests)",
    "fsdp_dtensor": "Megatron-FSDP allocates its parameter and gradient buffers on a CUDA device; on a CPU "
    "host the model cannot be wrapped, and its optimizer format (distrib_optim_sharding_type fsdp_dtensor) "
    "needs it. Without it nothing deeper resumes: save_checkpoint's fsdp_dtensor branch with a plain DDP "
    "model and Megatron's non-distributed optimizer stops in ChainedOptimizer.sharded_state_dict "
    "(KeyError: 0, the optimizer's parameters are not in the fsdp_dtensor model state; measured on "
    "0.19.2). The RNG entry of that format is round-tripped by rng-under-ep's checks",
}


def by_name(name: str) -> Config:
    for cfg in CONFIGS + KNOWN_FAILING:
        if cfg.name == name:
            return cfg
    raise KeyError(f"unknown resume configuration {name!r}; known: {', '.join(c.name for c in CONFIGS)}")
