"""rng-under-ep: every rank saves and restores its own RNG state in ``torch_dist`` checkpoints.

``megatron.training.checkpointing.get_rng_state`` declares the data-parallel ranks of one (pp, tp)
replicas of the ``torch_dist`` RNG state, so one of them writes and all restore its copy. They are
not replicas: the expert-parallel RNG stream is seeded per EP rank, so after a resume every EP rank
> 0 draws another rank's MoE router noise and expert dropout (and its Python, NumPy, torch and CUDA
state). ``fsdp_dtensor`` resumes every rank on a mix; Megatron-Bridge, verl and ms-swift keep their
own copies of the bug.

Upstream: NVIDIA/Megatron-LM PR #6858 (main only); NVIDIA-NeMo/Megatron-Bridge #5988.
Affected: Megatron-Core 0.17.0-0.19.2; ms-swift <= 4.6.0, Megatron-Bridge <= 0.6.2, verl <= 0.9.1.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from ...engine.fix import Fix, Target

ID = "rng-under-ep"
MODULE = "megatron.training.checkpointing"

FIX = Fix(
    id=ID,
    summary="torch_dist RNG state is saved and restored per (pp, tp, dp_cp) rank: EP ranks > 0 keep their own streams",
    affected=">=0.17.0,<=0.19.2",
    upstream=(
        "NVIDIA/Megatron-LM PR #6858 (upstream main only): each rank restores its own RNG state",
        "NVIDIA-NeMo/Megatron-Bridge #5988: the same per-rank (pp, tp, dp_cp) RNG layout in Bridge",
    ),
    targets=(
        Target(MODULE),
        Target(
            "swift.megatron.utils.megatron_lm_utils",
            package="ms-swift",
            affected="<=4.6.0",
        ),
        Target(
            "megatron.bridge.training.checkpointing",
            package="megatron-bridge",
            affected="<=0.6.2",
        ),
        Target(
            "verl.utils.checkpoint.megatron_checkpoint_manager",
            package="verl",
            affected="<=0.9.1",
        ),
    ),
)
