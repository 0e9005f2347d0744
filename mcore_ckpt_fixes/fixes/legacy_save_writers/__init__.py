"""legacy-save-writers: a legacy (``torch`` format) save writes every ``mp_rank_*`` file, each from one rank.

A legacy save writes ``mp_rank_{tp}[_{pp}][_{ep}]/model_optim_rng.pt`` only where
``mpu.get_expert_data_parallel_rank() == 0``. The file name follows the dense TP rank, the expert
data-parallel group does not: with TP > EP x expert TP (TP=2, EP=1, expert TP=1 on 2 ranks)
``mp_rank_01`` is never written. The save returns, the tracker records the iteration, and only the
resumed run finds the file missing (``[Errno 2] No such file or directory``).

Upstream: NVIDIA/Megatron-LM#4678 (0.18.0 also lets dense data-parallel rank 0 write).
Affected: Megatron-Core 0.17.x (``megatron/training`` ships in the wheel from 0.17.0).
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
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
    targets=(Target(MODULE),),
)
