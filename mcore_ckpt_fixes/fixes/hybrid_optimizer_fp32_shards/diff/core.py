"""hybrid-optimizer-fp32-shards as Megatron-Core would carry it: the minimal edit of the release's own
line in ``DistributedOptimizer._build_model_and_main_param_groups``
(``megatron/core/optimizer/distrib_optimizer.py``): with ``optimizer_cpu_offload`` an fp32
parameter's shard is taken of the detached parameter, the same tensor runtime/core.py's wrapper puts
in its place (a leaf view of the parameter's storage). tests/patches proves the diff by running the
same round trips with the monkeypatch off.
"""

from __future__ import annotations

from ....sourcediff import Replace

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_OLD = (
    "                elif model_param.type() == 'torch.cuda.FloatTensor':\n"
    "                    shard_model_param = model_param.view(-1)[param_range.start : param_range.end]\n"
)
_NEW = (
    "                elif model_param.type() == 'torch.cuda.FloatTensor':\n"
    "                    # HybridDeviceOptimizer (cpu offload) is rebuilt over the shards by torch's\n"
    "                    # Optimizer constructor, which refuses a view autograd tracks: a view of the\n"
    "                    # detached parameter shares its storage and is a leaf.\n"
    "                    shard_source = model_param.detach() if config.optimizer_cpu_offload else model_param\n"
    "                    shard_model_param = shard_source.view(-1)[param_range.start : param_range.end]\n"
)


def source_edits(release: str) -> list:
    return [Replace(TARGET, _OLD, _NEW)]
