"""Bit-exact tensor comparison for round trips (imported inside ranks)."""

from __future__ import annotations

import hashlib


# What a tensor that differs only in its bits counts as (a -0.0 for a 0.0, another NaN payload):
# the smallest positive float, so that 0.0 always means "the same bytes".
BITS_DIFFER = 5e-324


def max_abs_delta(expected, got) -> float:
    """0.0 when the two tensors have the same dtype, shape and bytes; else the largest absolute
    difference of their values, at least :data:`BITS_DIFFER` (values equal but bits not: a signed
    zero, a NaN's payload); ``inf`` when their shapes or dtypes differ (a rank that loaded another
    layout or precision did not load what it saved). Two empty tensors of one dtype: 0.0."""
    import torch

    if tuple(expected.shape) != tuple(got.shape) or expected.dtype != got.dtype:
        return float("inf")
    a, b = expected.detach().cpu().contiguous(), got.detach().cpu().contiguous()
    if a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        return 0.0
    if a.is_floating_point() or a.is_complex():
        delta = float((a.double() - b.double()).abs().max())
    else:
        delta = float((a.long() - b.long()).abs().max()) if a.dtype != torch.bool else 1.0
    return delta if delta > 0.0 else BITS_DIFFER


def worst(deltas) -> float:
    """The largest of ``deltas`` (0.0 for none); NaN when any is NaN: Python's ``max()`` keeps or
    drops a NaN depending on where it stands, so a NaN loaded after an exact tensor read as 0.0."""
    deltas = list(deltas)
    if any(d != d for d in deltas):
        return float("nan")
    return max(deltas, default=0.0)


def digest(tensor) -> str:
    """A fingerprint of a tensor's dtype, shape and bytes: equal digests, equal tensors. Lets the
    judgement of a world (which sees every rank's result, never a tensor) tell whose values a rank
    loaded."""
    import torch

    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def part_digests(tensor, sizes=None) -> list:
    """:func:`digest` of each consecutive part of a flat tensor (``sizes``: the parts' numbers of
    elements, e.g. the components of a fused tensor, each of which a load may take from another
    rank), or of the whole tensor when no such split applies."""
    if sizes is None or tensor.dim() != 1 or sum(sizes) != tensor.numel():
        return [digest(tensor)]
    return [digest(p) for p in tensor.split(list(sizes))]
