"""strictness-return-keys' round trip as the suite and ``selftest`` find it (no torch, no Megatron
here). World 2: the resume check's small GPT saved by megatron.training's ``save_checkpoint`` and
loaded by ``load_checkpoint`` with ``--dist-ckpt-strictness return_unexpected`` and ``return_all``,
then with ``--no-load-optim`` under ``return_all`` and ``log_all`` (see checks/core.py).
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# load_checkpoint reads the returned (state dict, missing keys, unexpected keys) as the state dict.
RETURNED_TUPLE = Bug.raises("load", "AttributeError: 'tuple' object has no attribute 'get'")

SCENARIOS = (
    Scenario(
        ID,
        "return_strictness_load",
        f"{_CORE}:round_trip",
        2,
        {">=0.17.0,<=0.19.2": RETURNED_TUPLE},
        prepare=f"{_CORE}:prepare",
        requires=("megatron.training.checkpointing:load_checkpoint",),
        doc="dense GPT, DP=2, saved by megatron.training and loaded with --dist-ckpt-strictness "
        "return_unexpected and return_all (every tensor of the model and the distributed optimizer "
        "compared), then with --no-load-optim under return_all and log_all (the keys each reports)",
    ),
)
