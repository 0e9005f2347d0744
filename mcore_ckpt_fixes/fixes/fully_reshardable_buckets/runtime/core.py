"""fully-reshardable-buckets' monkeypatch on ``megatron.core.optimizer.distrib_optimizer``:
``DistributedOptimizer.sharded_param_state_fully_reshardable`` and the gather it calls,
``get_parameter_state_dp_zero``, and the probe. Why: the package's docstring. Imported only when
the target module is.

The save marks, in a context variable of this module, which optimizer it runs for; the gather lays
its result out as the gradient buffers for that optimizer in that context only (a thread saving
another optimizer, or the ``torch`` format's save, gets the release's layout). Nothing is swapped on
the instance for the length of a call.
"""

from __future__ import annotations

import contextvars
import types

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
METHOD = "sharded_param_state_fully_reshardable"
GATHER = "get_parameter_state_dp_zero"


def bucket_shifts(buffer):
    """Per bucket, where its values start in the gathered world tensor minus where they start in the
    gradient buffer (``param_index_map``'s positions): 0 for the first bucket, and for each later
    one minus the padding that ended the buckets before it."""
    shifts, start = [], 0
    for bucket in buffer.buckets:
        shifts.append(start - bucket.offset)
        start += bucket.numel_unpadded
    return shifts


def laid_out_as_the_buffer(buffer, world):
    """``world`` (buckets back to back) laid out as the gradient buffer: each bucket's values at its
    offset, zero in the padding between buckets."""
    import torch

    buckets, shifts = buffer.buckets, bucket_shifts(buffer)
    length = max(b.offset + b.numel_unpadded for b in buckets)
    out = torch.zeros((length,), dtype=world.dtype, device=world.device)
    for bucket, shift in zip(buckets, shifts):
        start = bucket.offset + shift
        out[bucket.offset : bucket.offset + bucket.numel_unpadded] = world[start : start + bucket.numel_unpadded]
    return out


def _laid_out_as_the_buffers(self, state):
    import torch

    if state is None:  # memory-efficient mode, data-parallel rank > 0
        return None
    for gbuf_idx, buffer in enumerate(self.buffers):
        if gbuf_idx not in state or not any(bucket_shifts(buffer)):
            continue
        for world_tensors in state[gbuf_idx].values():
            for key, value in world_tensors.items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    world_tensors[key] = laid_out_as_the_buffer(buffer, value)
    return state


# The distributed optimizer whose fully_reshardable save runs in this context (its gather is read
# laid out as its gradient buffers), or None.
_SAVING = contextvars.ContextVar("mcore_ckpt_fixes_fully_reshardable_saving", default=None)


@layer(ID, MODULE, METHOD, owner=CLASS)
def sharded_param_state_fully_reshardable(below_us, self, *args, **kwargs):
    """The release's method; inside it, this optimizer's gather (:func:`get_parameter_state_dp_zero`)
    gives world tensors laid out as the gradient buffers, where the method looks each parameter up,
    wherever a buffer's buckets sit elsewhere in the gathered world tensor."""
    if not any(any(bucket_shifts(b)) for b in self.buffers):
        return below_us(self, *args, **kwargs)
    token = _SAVING.set(self)
    try:
        return below_us(self, *args, **kwargs)
    finally:
        _SAVING.reset(token)


@layer(ID, MODULE, GATHER, owner=CLASS)
def get_parameter_state_dp_zero(below_us, self, *args, **kwargs):
    """``DistributedOptimizer.get_parameter_state_dp_zero``: the release's gather; called for this
    optimizer's fully_reshardable save in this context, laid out as the gradient buffers. Every other
    caller (the ``torch`` format's save, dp_zero checkpoints) gets the release's layout."""
    state = below_us(self, *args, **kwargs)
    if _SAVING.get() is self:
        return _laid_out_as_the_buffers(self, state)
    return state


# -- probe: the release's own method on an inert stand-in -------------------------------------------


def _release_method(cls, name):
    fn = cls.__dict__[name]
    return original(cls, name) if is_replacement(fn) else fn


def saves_from_padded_offsets(module) -> bool:
    """Two buckets, the first padded (values at 0:2, its padding at 2:4; the second bucket at 4:8 in
    the buffer, at 2:6 in the gathered world tensor): which values does the release save for the
    second bucket's parameter?"""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    p0, p1 = torch.zeros(2), torch.zeros(2)
    buffer = types.SimpleNamespace(
        param_index_map={p0: (0, 2, 0), p1: (4, 6, 1)},
        numel_unpadded=6,
        buckets=[types.SimpleNamespace(offset=0, numel_unpadded=2), types.SimpleNamespace(offset=4, numel_unpadded=4)],
    )
    world = {"param": torch.arange(6.0), "numel_unpadded": 6}
    standin = types.SimpleNamespace(
        buffers=[buffer],
        gbuf_ranges=[{torch.float32: [None, None]}],
        get_parameter_state_dp_zero=lambda **kwargs: {0: {torch.float32: world}},
    )
    model_sd = {"p0": ShardedTensor.from_rank_offsets("p0", p0), "p1": ShardedTensor.from_rank_offsets("p1", p1)}
    out = _release_method(module.__dict__[CLASS], METHOD)(standin, model_sd, False, {})
    return out[1]["param"].data.tolist() != [2.0, 3.0]


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{METHOD} (fully_reshardable format)"
    if not saves_from_padded_offsets(module):
        return False, f"{CLASS}.{METHOD} saves each parameter from its place in the gathered state"
    return True, (
        f"{CLASS}.{METHOD} saves a parameter of a later bucket from its offset in the padded gradient "
        "buffer, not from its place in the gathered state"
    )
