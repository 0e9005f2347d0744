"""chained-optim-main-params-split's round trips as the suite and ``selftest`` find them (no torch,
no Megatron here).

A bf16 MoE GPT, Megatron's DDP and ``get_megatron_optimizer``'s ``ChainedOptimizer`` (dense and
expert distributed optimizers), main parameters reloaded from an fp32 checkpoint as
``--no-load-optim --load-main-params-from-ckpt`` does (see checks/core.py). Each scenario is one
case of ``core.CASES``; tests/fixes/test_chained_optim_main_params_split.py runs both in one world
per half.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
_PREPARE = f"{_CORE}:prepare"
_AFFECTED = ">=0.14.0,<0.18.0"
# Silent in the release: the reload completes; the check names what the expert optimizer holds.
BF16_MAIN_PARAMS = Bug.raises(
    "main_params",
    "AssertionError: main parameters of the expert optimizer hold the bf16 model parameters, "
    "not the checkpoint's fp32 values",
)
# Two chunks per rank, both sub-optimizers covering both: the running offset runs past the last one.
OFFSET_PAST_LAST_CHUNK = Bug.raises("reload", "AssertionError: Wrong state_dict format, cannot find 'model2'")

SCENARIOS = (
    Scenario(
        ID,
        "one_chunk",
        f"{_CORE}:one_chunk",
        2,
        {_AFFECTED: BF16_MAIN_PARAMS},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        doc="MoE GPT (EP=2), one chunk: main parameters reloaded from an fp32 checkpoint",
    ),
    Scenario(
        ID,
        "two_chunks",
        f"{_CORE}:two_chunks",
        4,
        {_AFFECTED: OFFSET_PAST_LAST_CHUNK},
        prepare=_PREPARE,
        batch=f"{_CORE}:cases",
        doc="MoE GPT (PP=2 with two virtual stages, EP=2), two chunks per rank: the same reload",
    ),
)
