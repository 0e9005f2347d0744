"""hybrid-optimizer-fresh-load as Megatron-Core would carry it: the minimal edits of the release's own
lines. ``DistributedOptimizer._copy_model_params_to_main_params``
(``megatron/core/optimizer/distrib_optimizer.py``): the hybrid optimizer's branch refreshes the fp32
main shards (without the precision-aware optimizer) and every copy its sub-optimizers step, as
runtime/core.py's layer does after the release's call. ``load_checkpoint``
(``megatron/training/checkpointing.py``, 0.17 on): a load without the optimizer's state reloads the
model params under ``--optimizer-cpu-offload`` in an fp32 run too, which the hybrid branch above
turns into a refresh of its copies; runtime/core.py's layer refreshes the copies of the parameters'
own dtype after the release's call. tests/patches proves the diff by
running the same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

OPTIMIZER = "megatron/core/optimizer/distrib_optimizer.py"
CHECKPOINTING = "megatron/training/checkpointing.py"

_HYBRID_OLD = (
    "        if isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "            self.optimizer.update_fp32_param_by_new_param()\n"
    "            return\n"
)
_HYBRID_NEW = (
    "        if isinstance(self.optimizer, HybridDeviceOptimizer):\n"
    "            # Without the precision-aware optimizer the hybrid optimizer's parameters are the fp32\n"
    "            # main shards; and its sub-optimizers step copies of its parameters (CPU clones, fp32\n"
    "            # copies). A model loaded without the optimizer's state must reach both.\n"
    "            if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:\n"
    "                for shards, mains in zip(\n"
    "                    self.shard_float16_groups, self.shard_fp32_from_float16_groups\n"
    "                ):\n"
    "                    for shard, main in zip(shards, mains):\n"
    "                        if shard is not None and main is not None:\n"
    "                            main.data.copy_(shard)\n"
    "            self.optimizer.update_fp32_param_by_new_param()\n"
    "            for group in self.optimizer.param_groups:\n"
    "                for param in group['params']:\n"
    "                    inner = self.optimizer.param_to_inner_param.get(param, param)\n"
    "                    if inner is not param:\n"
    "                        inner.data.copy_(param.data)\n"
    "            return\n"
)
_RELOAD_OLD = "        if (args.fp16 or args.bf16) and optimizer is not None:\n"
_RELOAD_NEW = (
    "        # An fp32 run has no main params to reload, but the hybrid optimizer (--optimizer-cpu-offload)\n"
    "        # steps CPU copies of the parameters, which must hold the weights just loaded.\n"
    "        if (args.fp16 or args.bf16 or args.optimizer_cpu_offload) and optimizer is not None:\n"
)


def source_edits(release: str) -> list:
    return [
        Replace(OPTIMIZER, _HYBRID_OLD, _HYBRID_NEW),
        Replace(CHECKPOINTING, _RELOAD_OLD, _RELOAD_NEW, optional=True),
    ]
