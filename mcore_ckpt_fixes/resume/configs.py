"""The configurations the resume check trains, stops and resumes.

Each is a small GPT trained through Megatron's own model, DDP, distributed optimizer, scheduler and
``megatron.training.checkpointing`` (:mod:`mcore_ckpt_fixes.testing.gpt_job`), unless ``job`` names another (the MIMO model's,
Megatron-Bridge's, verl's and ms-swift's save and load). ``needs`` names the fixes without which the
configuration cannot resume exactly on a release those fixes apply to: the check asserts that the
fixes-off run diverges exactly there, and only there. ``expect="as-release"`` holds the resumed run
with the fixes to the release's own resumed run instead of the uninterrupted one (options whose
resume is not meant to be exact); ``resume_args`` lists several ways run C resumes in one world.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Tuple

from ..fixes.mimo_optimizer.checks.scenarios import MIMO_SAVE_SIDE
from ..testing.job_config import Config

# The --dist-ckpt-strictness values with which dist_checkpointing.load returns the loaded state
# dict; return_unexpected and return_all return it with the mismatching keys, which
# megatron.training's load_checkpoint does not take apart (fix strictness-return-keys,
# configuration dense-dp2-strictness-return).
STRICTNESS_LOADING = (
    "assume_ok_unexpected",
    "log_unexpected",
    "raise_unexpected",
    "log_all",
    "raise_all",
    "ignore_all",
)


def both_formats(cfg: Config):
    """``cfg`` and its twin that saves the distributed optimizer in the other format: named with that
    format as a suffix (``-fully-reshardable``, ``-dp-reshardable``), its summary saying it."""
    other = "fully_reshardable" if cfg.optim_format == "dp_reshardable" else "dp_reshardable"
    twin = replace(
        cfg,
        name=f"{cfg.name}-{other.replace('_', '-')}",
        summary=cfg.summary.replace(f"({cfg.optim_format})", f"({other})"),
        optim_format=other,
    )
    return cfg, twin


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
        "dense-dp2-padded-buckets",
        "dense GPT, DP=2, --overlap-grad-reduce with several buckets, --ddp-pad-buckets-for-high-nccl-busbw "
        "(each bucket padded to 65536 elements: rank 1's half of each all padding), distributed optimizer "
        "(dp_reshardable)",
        world=2,
        ddp_bucket_size=1000,
        extra_args=("--ddp-pad-buckets-for-high-nccl-busbw",),
        needs=("dp-reshardable-padding",),
    ),
    Config(
        "dense-dp2-decoupled-lr",
        "dense GPT, DP=2, --decoupled-lr (the embedding and output layer's own learning rate), "
        "distributed optimizer (dp_reshardable)",
        world=2,
        decoupled_lr=0.03,
        needs=("param-group-identity",),
        # 0.19 matches such groups by max_lr itself (param-group-identity's 0.19 defect is another).
        needs_releases="<0.19",
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
        needs_releases="<0.19",
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
        "dense-dp2-strictness-values",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --rerun-mode validate_results; resumed once "
        "per --dist-ckpt-strictness value that hands load_checkpoint the loaded state (six, in one world)",
        world=2,
        rerun_mode="validate_results",
        resume_args=tuple(("--dist-ckpt-strictness", value) for value in STRICTNESS_LOADING),
        # raise_all only: 0.18+ writes the machine's idle entry, which load_checkpoint does not ask for.
        needs=("rerun-state-strict-load",),
        needs_releases=">=0.18",
    ),
    Config(
        "dense-dp2-strictness-return",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable); resumed once per --dist-ckpt-strictness value "
        "that returns the mismatching keys with the loaded state (return_unexpected, return_all; in one world)",
        world=2,
        resume_args=(("--dist-ckpt-strictness", "return_unexpected"), ("--dist-ckpt-strictness", "return_all")),
        # Without the fix load_checkpoint takes the returned (state dict, missing, unexpected) for the state dict.
        needs=("strictness-return-keys",),
    ),
    Config(
        "dense-dp2-save-options",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable), --rerun-mode disabled (set up as "
        "initialize_megatron does), --dist-ckpt-save-pre-mcore-014 and --async-save without a persistent "
        "worker (which megatron.training turns off, saying so)",
        world=2,
        rerun_mode="disabled",
        extra_args=("--dist-ckpt-save-pre-mcore-014", "--async-save"),
    ),
    Config(
        "dense-dp2-new-lr-checkpoint-scheduler",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable); resumed with a new --lr / --min-lr and "
        "--use-checkpoint-opt-param-scheduler: the checkpoint's schedule goes on, exactly",
        world=2,
        resume_args=(("--use-checkpoint-opt-param-scheduler", "--lr", "0.02", "--min-lr", "0.002"),),
        # 0.19 matches the saved param groups by max_lr / min_lr: the load stops without the fix.
        needs=("param-group-identity",),
        needs_releases=">=0.19",
    ),
    Config(
        "dense-dp2-new-wd-checkpoint-scheduler",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable); resumed with a new --weight-decay and "
        "--use-checkpoint-opt_param-scheduler: the checkpoint's weight decay from the first resumed step on, exactly",
        world=2,
        resume_args=(("--use-checkpoint-opt_param-scheduler", "--weight-decay", "0.05"),),
        # Without the fix the first resumed step decays with 0.05, the saved 0.01 from the next one on.
        needs=("scheduler-checkpoint-wd",),
    ),
    Config(
        "dense-dp2-resume-options",
        "dense GPT, DP=2, distributed optimizer (dp_reshardable); resumed once per option whose resume is "
        "not meant to equal the uninterrupted run (in one world), each held to the release's own resume",
        world=2,
        expect="as-release",
        resume_args=(
            ("--no-load-optim",),
            ("--no-load-rng",),
            ("--finetune",),
            ("--use-checkpoint-opt-param-scheduler",),
        ),
    ),
    # Pipeline layouts: Megatron's own schedule (get_model, get_forward_backward_func, finalize_model_grads),
    # tied embeddings on the first and last stage (Megatron's default); each with both optimizer formats.
    *both_formats(
        Config(
            "gpt-pp2",
            "dense GPT, PP=2 (1F1B schedule, tied embeddings), distributed optimizer (dp_reshardable)",
            world=2,
            pp=2,
        )
    ),
    *both_formats(
        Config(
            "gpt-pp2-vpp2",
            "dense GPT, interleaved PP=2 x VPP=2 (4 layers, 2 chunks per rank), distributed optimizer (dp_reshardable)",
            world=2,
            pp=2,
            vpp=2,
        )
    ),
    *both_formats(
        Config(
            "gpt-pp2-dp2",
            "dense GPT, PP=2 x DP=2 on 4 ranks, distributed optimizer (dp_reshardable)",
            world=4,
            pp=2,
        )
    ),
    Config(
        "gpt-pp2-dp2-overlap-buckets",
        "dense GPT, PP=2 x DP=2 on 4 ranks, --overlap-grad-reduce with a 1,000-element bucket size "
        "(the first stage's buffer in several buckets, the tied embedding in a bucket of its own on "
        "both stages), distributed optimizer (dp_reshardable)",
        world=4,
        pp=2,
        extra_args=("--overlap-grad-reduce", "--ddp-bucket-size", "1000"),
    ),
    Config(
        "gpt-pp2-dp2-tied-padding",
        "dense GPT, PP=2 x DP=2 on 4 ranks, hidden size 26: on the first stage the bucket before the tied "
        "word embedding ends at its 64-aligned start, past its last parameter, and data-parallel rank 1's "
        "shard runs on into the bucket's padding (NVIDIA/Megatron-LM#5898), distributed optimizer (dp_reshardable)",
        world=4,
        pp=2,
        hidden=26,
        needs=("dp-reshardable-padding",),
    ),
    Config(
        "gpt-pp2-strict-validate-results",
        "dense GPT, PP=2, distributed optimizer (dp_reshardable), --rerun-mode validate_results and "
        "--dist-ckpt-strictness raise_all: the rerun state machine's entry saved and loaded per stage",
        world=2,
        pp=2,
        strictness="raise_all",
        rerun_mode="validate_results",
        needs=("rerun-state-strict-load",),
        needs_releases=">=0.18",
    ),
    *both_formats(
        Config(
            "gpt-tp2-pp2-sp",
            "dense GPT, TP=2 x PP=2 with sequence parallelism on 4 ranks, distributed optimizer (dp_reshardable)",
            world=4,
            tp=2,
            pp=2,
            extra_args=("--sequence-parallel",),
        )
    ),
    *both_formats(
        Config(
            "moe-pp2-ep2",
            "MoE GPT, PP=2 x EP=2 (x DP=2) on 4 ranks, distributed optimizer (dp_reshardable)",
            world=4,
            pp=2,
            ep=2,
            needs=("rng-under-ep",),
        )
    ),
    *both_formats(
        Config(
            "moe-tp2-ep2-etp2",
            "MoE GPT, TP=2 with expert TP=2 and EP=2 (x DP=2) on 4 ranks, sequence parallel, distributed "
            "optimizer (fully_reshardable)",
            world=4,
            tp=2,
            ep=2,
            etp=2,
            optim_format="fully_reshardable",
            needs=("rng-under-ep",),
        )
    ),
    *both_formats(
        Config(
            "gpt-tp2-pp2-dp2",
            "dense GPT, TP=2 x PP=2 x DP=2 on 8 ranks, sequence parallel, distributed optimizer (dp_reshardable)",
            world=8,
            tp=2,
            pp=2,
            extra_args=("--sequence-parallel",),
        )
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
    "--async-save with --use-persistent-ckpt-worker": "megatron.training (0.17.1, 0.18.2, 0.19.2) saves "
    "asynchronously only with a persistent worker (without one it turns --async-save off: configuration "
    "dense-dp2-save-options). Its default writer (--async-strategy nvrx) needs nvidia-resiliency-ext, which is not "
    "installed here; Megatron-Core's own (--async-strategy mcore) starts the worker in a new process (forkserver) "
    "whose first call is torch.cuda.set_device(rank % torch.cuda.device_count()): on a CPU host it dies with "
    "ZeroDivisionError and the save never completes",
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
