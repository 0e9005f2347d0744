"""hybrid-optimizer-fresh-load: under ``--optimizer-cpu-offload`` a load of the model's weights without
the optimizer's state (``--no-load-optim``, ``--finetune``, ``reload_model_params``) trains on them.

The hybrid optimizer steps its own copies of its parameters (CPU clones, fp32 copies) and, without
the precision-aware optimizer, its parameters are the distributed optimizer's fp32 main shards:
``_copy_model_params_to_main_params`` refreshes neither the main shards nor the fp32 parameters'
clones (0.12: nothing), and ``load_checkpoint`` asks for no refresh in an fp32 run. The first step
writes the weights the optimizer was built over back into the model, silently.

Upstream: not reported or fixed as of 0.19.2. Affected: Megatron-Core 0.12.0-0.19.2.
How: after the release's refresh, the main shards and every copy the sub-optimizers step are copied
from the model; after ``load_checkpoint``, the copies of the parameters' own dtype. Story: doc.md.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "hybrid-optimizer-fresh-load"
MODULE = "megatron.core.optimizer.distrib_optimizer"
CLASS = "DistributedOptimizer"
FUNCTION = "_copy_model_params_to_main_params"
TRAINING = "megatron.training.checkpointing"

FIX = Fix(
    id=ID,
    summary=(
        "--optimizer-cpu-offload: a load of the model without the optimizer's state (--no-load-optim, "
        "--finetune, reload_model_params) refreshes the hybrid optimizer's main shards and copies, where the "
        "first step wrote the weights it was built over back into the model"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not reported upstream as of Megatron-Core 0.19.2 (DistributedOptimizer._copy_model_params_to_main_params "
        "returns early for HybridDeviceOptimizer)",
    ),
    targets=(Target(MODULE), Target(TRAINING, "probe_training")),
)
