"""dp-reshardable-padding's monkeypatch on ``megatron.core.optimizer.distrib_optimizer``:
``DistributedOptimizer.sharded_param_state_dp_reshardable`` and the state it describes,
``get_parameter_state_dp_reshardable``, and the probe. Why: the package's docstring. Imported only
when the target module is.

The method marks, in a context variable of this module, which optimizer it describes; the state
getter adds its padding pieces for that optimizer in that context only (any other caller gets the
release's state). Nothing is swapped on the instance for the length of a call.
"""

from __future__ import annotations

import contextvars
import types

import torch

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from .. import ID, MODULE

CLASS = "DistributedOptimizer"
METHOD = "sharded_param_state_dp_reshardable"
STATE = "get_parameter_state_dp_reshardable"

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/distrib_optimizer.py, above class DistributedOptimizer.


def _padding_piece(like, start, end):
    """A padding piece of this rank's shard, ``[start, end)``, with a tensor per tensor of ``like``
    (a piece of the same rank's state), as the release shapes the padding between parameters."""
    piece = {
        key: torch.empty(end - start, dtype=value.dtype, device=value.device)
        for key, value in like.items()
        if isinstance(value, torch.Tensor)
    }
    piece.update(gbuf_local_start=start, gbuf_local_end=end, padding=True)
    return piece


def _pad_to_unpadded_bucket_ends(optimizer, state):
    """Give each bucket of ``state`` (``get_parameter_state_dp_reshardable``'s) the padding pieces
    that make this rank's pieces cover exactly its part of the bucket's checkpoint tensor, which is
    ``numel_unpadded`` long, where ``sharded_param_state_dp_reshardable``'s own gap filling cannot:

    * the shard's last parameter ends before the unpadded end and the shard after it: the end gap
      would run past the tensor (a bucket closed by a tied embedding or MTP layer with PP > 1 ends
      at the embedding's aligned start, past its last parameter): it ends at the unpadded end;
    * the shard holds no parameter but starts before the unpadded end: one padding piece up to it;
    * the shard lies wholly in the bucket's end padding: an empty padding piece (nothing is saved
      or loaded; an empty bucket is refused).

    Elsewhere the state is left as it is: the gap filling is right there.
    """
    rank = optimizer.data_parallel_group.rank()
    size = optimizer.data_parallel_group.size()
    buckets_by_buffer = [state[gbuf_idx] for gbuf_idx in range(len(optimizer.gbuf_ranges))]
    like = next((p for b in buckets_by_buffer for bs in b.values() for ps in bs for p in ps), None)
    for gbuf_idx, buckets_by_dtype in enumerate(buckets_by_buffer):
        for buckets in buckets_by_dtype.values():
            for bucket_idx, pieces in enumerate(buckets):
                bucket = optimizer.buffers[gbuf_idx].buckets[bucket_idx]
                shard_numel = bucket.grad_data.numel() // size
                unpadded_end = bucket.numel_unpadded - rank * shard_numel  # in this shard
                if pieces:
                    last_end = pieces[-1]["gbuf_local_end"]
                    if last_end < unpadded_end < shard_numel:
                        pieces.append(_padding_piece(pieces[-1], last_end, unpadded_end))
                    continue
                start = min(max(unpadded_end, 0), shard_numel)
                if not start:
                    # Wholly in the end padding: an empty piece at the tensor's end, so that the
                    # rank's request keeps the bucket (a bucket without a piece drops out of its
                    # list, which then no longer lines up with the other ranks' on load); it reads
                    # and writes nothing. A rank holding no parameter at all has no piece to shape
                    # it like: the main parameter's (fp32) alone.
                    empty_like = like or {"param": torch.empty(0, device=bucket.grad_data.device)}
                    pieces.append(_padding_piece(empty_like, unpadded_end, unpadded_end))
                elif like is None:
                    raise ValueError(
                        f"dp_reshardable: data-parallel rank {rank} holds no parameter, so no state to "
                        f"shape its padding of bucket {bucket_idx} of gradient buffer {gbuf_idx} like; "
                        "use a smaller data-parallel size or bigger buckets"
                    )
                else:
                    pieces.append(_padding_piece(like, 0, start))
    return state


# -- end of replacement ---


# The distributed optimizer whose dp_reshardable state is being described in this context, or None.
_DESCRIBING = contextvars.ContextVar("mcore_ckpt_fixes_dp_reshardable_describing", default=None)


@layer(ID, MODULE, METHOD, owner=CLASS)
def sharded_param_state_dp_reshardable(below_us, self, *args, **kwargs):
    """The release's method; inside it, this optimizer's state (:func:`get_parameter_state_dp_reshardable`)
    carries the padding pieces its gap filling cannot make."""
    token = _DESCRIBING.set(self)
    try:
        return below_us(self, *args, **kwargs)
    finally:
        _DESCRIBING.reset(token)


@layer(ID, MODULE, STATE, owner=CLASS)
def get_parameter_state_dp_reshardable(below_us, self, *args, **kwargs):
    """``DistributedOptimizer.get_parameter_state_dp_reshardable``: the release's state; for this
    optimizer's own ``sharded_param_state_dp_reshardable`` in this context, with the padding pieces
    of :func:`_pad_to_unpadded_bucket_ends`. Every other caller gets the release's state."""
    state = below_us(self, *args, **kwargs)
    if _DESCRIBING.get() is self:
        return _pad_to_unpadded_bucket_ends(self, state)
    return state


# -- probe: the release's own method on inert stand-ins --------------------------------------------


def _release_method(cls, name):
    fn = cls.__dict__[name]
    return original(cls, name) if is_replacement(fn) else fn


def optimizer_stand_in(rank, buckets, world=2):
    """An optimizer of ``world`` data-parallel ranks with one gradient buffer, on ``rank``:
    ``buckets`` gives each bucket's (size, unpadded size, this rank's parameter pieces as (start,
    end) in its shard). Only what the method reads."""
    group = types.SimpleNamespace(rank=lambda: rank, size=lambda: world)
    state = {
        "per_bucket_numel": [[numel for numel, _, _ in buckets]],
        "per_bucket_numel_unpadded": [[unpadded for _, unpadded, _ in buckets]],
        0: {torch.float32: [[_param_piece(start, end) for start, end in pieces] for _, _, pieces in buckets]},
    }
    return types.SimpleNamespace(
        data_parallel_group=group,
        data_parallel_group_idx=0,
        distributed_optimizer_instance_id=0,
        gbuf_ranges=[{torch.float32: [None] * len(buckets)}],
        buffers=[
            types.SimpleNamespace(
                buckets=[types.SimpleNamespace(numel_unpadded=u, grad_data=torch.empty(n)) for n, u, _ in buckets]
            )
        ],
        get_parameter_state_dp_reshardable=lambda: state,
    )


def _param_piece(start, end):
    return {"param": torch.zeros(end - start), "gbuf_local_start": start, "gbuf_local_end": end}


def pieces(described):
    """Per bucket of a described state (the method's result), its pieces: (offset, length, tensor length)."""
    return [
        sorted(
            (v.global_offset[0], v.local_shape[0], v.global_shape[0])
            for piece in bucket
            for v in piece.values()
            if hasattr(v, "global_shape")
        )
        for bucket in described[0][torch.float32]
    ]


def defects(module) -> list:
    """What the release's method does with buckets of 8 elements over 2 ranks (4 each), on rank 1:
    holding none of a bucket's 3 unpadded elements (#6191; its parameter piece in another bucket),
    and holding a bucket's last parameter, which ends at 5, of 6 unpadded elements (#5898)."""
    method = _release_method(module.__dict__[CLASS], METHOD)
    found = []
    try:
        method(optimizer_stand_in(1, [(8, 3, []), (8, 8, [(0, 4)])]), {}, False)
    except AssertionError:
        found.append("refuses a rank whose shard of a bucket is all padding (AssertionError)")
    described = pieces(method(optimizer_stand_in(1, [(8, 6, [(0, 1)])]), {}, False))
    if any(offset + length > total for offset, length, total in described[0]):
        found.append("describes end padding past the bucket's unpadded size (DCP rejects the plan)")
    return found


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__ or STATE not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{METHOD} (dp_reshardable format)"
    found = defects(module)
    if not found:
        return False, f"{CLASS}.{METHOD} describes a bucket's end padding within the checkpoint tensor"
    return True, f"{CLASS}.{METHOD} " + "; ".join(found)
