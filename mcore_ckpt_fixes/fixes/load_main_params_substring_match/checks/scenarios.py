"""load-main-params-substring-match's round trip as the suite and ``selftest`` find it (no torch, no
Megatron here).

A bf16 MoE GPT whose experts are Megatron's ``TEGroupedMLP`` with 12 local experts (its grouped
linears stood in: no Transformer Engine on CPU), Megatron's DDP and ``get_megatron_optimizer``'s
optimizer, main parameters reloaded from an fp32 checkpoint as ``--no-load-optim
--load-main-params-from-ckpt`` does (see checks/core.py). The scenario is the EP=1 case, which
needs no other fix; tests/fixes/test_load_main_params_substring_match.py also runs the EP=2 case
(dense and expert optimizers) in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
_AFFECTED = ">=0.14.0,<0.17.0"
# The first parameter whose name is part of other keys: weight1 of weight10 and weight11.
THREE_MATCHES = Bug.raises(
    "reload", "AssertionError: Parameter decoder.layers.0.mlp.experts.linear_fc1.weight1 has 3 matches in state dict"
)

SCENARIOS = (
    Scenario(
        ID,
        "grouped_experts",
        f"{_CORE}:grouped_experts",
        2,
        {_AFFECTED: THREE_MATCHES},
        prepare=f"{_CORE}:prepare",
        batch=f"{_CORE}:cases",
        doc="MoE GPT with grouped experts (12 local experts, EP=1): main parameters reloaded from an fp32 checkpoint",
    ),
)
