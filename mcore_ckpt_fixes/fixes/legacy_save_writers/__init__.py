"""legacy-save-writers: a legacy (``torch`` format) save writes every ``mp_rank_*`` file, each from one rank.

Affected: Megatron-Core 0.17.x (``megatron/training`` ships in the wheel from 0.17.0), in
``megatron.training.checkpointing.save_checkpoint``. Upstream 0.18.0 (NVIDIA/Megatron-LM#4678) also
lets dense data-parallel rank 0 write.

Failure prevented: a legacy save writes ``mp_rank_{tp}[_{pp}][_{ep}]/model_optim_rng.pt`` only where
``mpu.get_expert_data_parallel_rank() == 0``. The file name follows the dense TP rank, the expert
data-parallel group does not: with TP > EP x ETP (TP=2, EP=1, expert TP=1 on 2 ranks: expert-DP size
2) TP rank 1 has expert-DP rank 1, so ``mp_rank_01`` is never written. The save returns, rank 0
records the iteration in the tracker, and only the resumed run finds the file missing
(``load_checkpoint`` prints ``[Errno 2] No such file or directory`` and exits on that rank).

How: ``save_checkpoint`` is wrapped. During a legacy save (not ``torch_dist`` / ``torch_dcp`` /
``fsdp_dtensor``, not non-persistent) every rank computes the file name the release will write for
it, the ranks exchange those names (one ``all_gather_object`` per legacy save), and the lowest
global rank of each name writes it: every file once, never two ranks on one file. The release's own
condition makes the decision: the module's ``mpu`` is replaced at apply by a view of
``parallel_state`` that, inside such a save and in its context (thread, task) only, answers
``get_expert_data_parallel_rank()`` with 0 on the elected rank and 1 on the others; every other
``mpu`` call, and every call outside a legacy save, is ``parallel_state``'s own. The files hold what the release writes; a checkpoint saved with the fix
loads on any release.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "legacy-save-writers"
MODULE = "megatron.training.checkpointing"

FIX = Fix(
    id=ID,
    summary=(
        "A legacy (torch format) save writes every mp_rank_* file, once: with TP > EP x ETP the "
        "files of expert-DP ranks > 0 were never written"
    ),
    affected=">=0.17.0,<0.18.0",
    upstream=("NVIDIA/Megatron-LM#4678 (0.18.0): dense data-parallel rank 0 writes too",),
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
