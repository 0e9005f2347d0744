"""fully-reshardable-buckets as Megatron-Core would carry it: a minimal edit of
``DistributedOptimizer.sharded_param_state_fully_reshardable`` in
``megatron/core/optimizer/distrib_optimizer.py``. Where runtime/core.py lays the gathered world
tensors out as the gradient buffer for the release's slicing, the source reads each parameter at its
place in the gathered tensors: its offset in the buffer, less the padding that ended the buckets
before its own (the same result; tests/patches proves it by running the same round trips with the
monkeypatch off).
"""

from __future__ import annotations

from ....sourcediff import Replace

TARGET = "megatron/core/optimizer/distrib_optimizer.py"

_LOOP_OLD = """                for model_param, (
                    param_world_start,
                    param_world_end,
                    _,
                ) in buffer.param_index_map.items():
"""
_LOOP_NEW = """                # The world tensors hold the buckets back to back, without the padding that
                # ends each bucket in the buffer; param_index_map counts it.
                bucket_shifts, gathered_start = [], 0
                for bucket in buffer.buckets:
                    bucket_shifts.append(gathered_start - bucket.offset)
                    gathered_start += bucket.numel_unpadded
                for model_param, (
                    param_world_start,
                    param_world_end,
                    bucket_id,
                ) in buffer.param_index_map.items():
"""
_SLICE_OLD = "                        state_ten = world_tensors[state_key][param_world_start:param_world_end]\n"
_SLICE_NEW = (
    "                        shift = bucket_shifts[bucket_id]\n"
    "                        state_ten = world_tensors[state_key][\n"
    "                            param_world_start + shift : param_world_end + shift\n"
    "                        ]\n"
)


def source_edits(release: str) -> list:
    return [Replace(TARGET, _LOOP_OLD, _LOOP_NEW), Replace(TARGET, _SLICE_OLD, _SLICE_NEW)]
