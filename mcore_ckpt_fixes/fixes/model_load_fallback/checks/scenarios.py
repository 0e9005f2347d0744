"""model-load-fallback's round trip as the suite and ``selftest`` find it (no torch, no Megatron
here). World 2: the resume check's small GPT saved by megatron.training's ``save_checkpoint`` in
``torch_dist`` and ``torch`` and loaded by ``load_checkpoint`` as it was saved and, fine-tuned with
the output layer untied, without the weight the checkpoint does not have (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# Silent in the release: the round trip says it, at the end of its load phase (checks/core.py).
SILENT = "AssertionError: load_checkpoint left model weights at their initial values that no error or warning names"
DROPPED_SILENTLY = Bug.raises("load", SILENT)

SCENARIOS = (
    Scenario(
        ID,
        "model_load_missing_weights",
        f"{_CORE}:round_trip",
        2,
        {">=0.13.0,<=0.19.2": DROPPED_SILENTLY},
        prepare=f"{_CORE}:prepare",
        requires=("megatron.training.checkpointing:load_checkpoint",),
        doc="dense GPT, DP=2, saved by megatron.training in torch and torch_dist and loaded by load_checkpoint "
        "as saved (exact), then with --untie-embeddings-and-output-weights --finetune (the checkpoint has no "
        "output_layer.weight) in torch, torch_dist, and torch_dist under log_all and ignore_all",
    ),
)
