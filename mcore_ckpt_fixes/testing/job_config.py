"""The configuration of a small training job built from Megatron's own parts
(:mod:`.gpt_job`): its parallel layout, optimizer, checkpoint options and, for the resume check,
the fixes it needs (test and selftest processes only; nothing heavy imported here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class Config:
    name: str
    summary: str
    world: int
    tp: int = 1
    pp: int = 1  # pipeline stages (> 1: trained with Megatron's pipeline schedule, pipeline_job)
    vpp: int = 0  # virtual stages (model chunks) per pipeline rank: the interleaved schedule (0: none)
    layers: int = 0  # transformer layers (0: two, or one per virtual stage where there are more)
    hidden: int = 16  # hidden size (heads: two)
    # Samples per step (0: one micro-batch per data-parallel rank, two per stage under PP). A job
    # resumed on another layout keeps it, as the schedule saved with the checkpoint counts in samples.
    global_batch: int = 0
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
    bf16: bool = True  # False: an fp32 model (no --bf16, no Float16Module)
    # Megatron-LM's --dist-ckpt-strictness ("" its default, assume_ok_unexpected) and --rerun-mode
    # ("": no rerun state machine set up, as a script that never calls initialize_megatron; Megatron-LM's
    # own default is validate_results, set up as initialize_megatron does).
    strictness: str = ""
    rerun_mode: str = ""
    # More of Megatron-LM's checkpoint options, as given on its command line (save and resume alike).
    extra_args: Tuple[str, ...] = ()
    # Options given to the resumed run only, one tuple per way of resuming: run C loads the one
    # checkpoint once per tuple, each time into a newly built and seeded job (arguments parsed
    # again, new model, optimizer, scheduler and rerun state machine) in the same processes. Empty:
    # run C resumes once with the configuration's own arguments.
    resume_args: Tuple[Tuple[str, ...], ...] = ()
    # What run C is held to. "exact": with the fixes it continues bit for bit as the release's own
    # uninterrupted run. "as-release", for options whose resume is not meant to equal the
    # uninterrupted run (the optimizer or RNG not loaded, --finetune): with the fixes it is the
    # release's own resume (run C without them) bit for bit on every rank, or fails as it does.
    expect: str = "exact"
    needs: Tuple[str, ...] = ()
    # Releases (a specifier) on which ``needs`` is what the fixes-off run shows; empty: wherever
    # the fix applies. A fix may apply to a release for a defect this configuration does not reach.
    needs_releases: str = ""
    # A user's own job (selftest --resume --megatron-args): its shrunk Megatron arguments, given as
    # they are (the run's length and checkpoint directory added); the model is built as
    # pretrain_gpt builds it from them. Empty: the arguments come from the fields above.
    megatron_argv: Tuple[str, ...] = ()
    job: str = "mcore_ckpt_fixes.testing.gpt_job:run"  # one rank of one run
    requires: str = ""  # a module the release must have, else the configuration is not applicable

    def __post_init__(self):
        if self.expect not in ("exact", "as-release"):
            raise ValueError(f"{self.name}: expect is 'exact' or 'as-release', not {self.expect!r}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def num_layers(self) -> int:
        """``layers``, else two, or one per (virtual) pipeline stage where there are more stages."""
        return self.layers or max(2, self.pp * max(self.vpp, 1))

    @property
    def global_batch_size(self) -> int:
        return self.global_batch or self.dp * self.microbatches

    @property
    def microbatches(self) -> int:
        """Micro-batches per step: one, or two per pipeline stage (the 1F1B schedule's steady
        state is reached, and the interleaved one needs a multiple of the stages)."""
        return 1 if self.pp == 1 else 2 * self.pp

    @property
    def sequence_parallel(self) -> bool:
        """MoE under TP trains only with sequence parallel (the job adds it); a dense job asks for it."""
        asked = "--sequence-parallel" in self.extra_args + self.megatron_argv
        return self.tp > 1 and (bool(self.ep) or asked)


# Samples per step of a job resumed on another layout: it keeps its global batch (its schedule counts
# samples); four divide among 1, 2 or 4 data-parallel ranks and 2 pipeline stages.
LAYOUT_GLOBAL_BATCH = 4


def moe_for_layout_change(name, world, ep, optim_format="fully_reshardable") -> Config:
    """The MoE GPT (two experts) that saves under one expert-parallel size and resumes under another."""
    return Config(
        name,
        f"MoE GPT, EP={ep} on {world} ranks ({optim_format})",
        world=world,
        ep=ep,
        optim_format=optim_format,
        global_batch=LAYOUT_GLOBAL_BATCH,
        # Without biases on both sides: with EP=1 an expert's output is returned as a view that
        # SequentialMLP adds the bias to in place, which autograd rejects (as under expert TP 1).
        extra_args=("--disable-bias-linear",),
    )
