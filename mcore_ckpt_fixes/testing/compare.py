"""Bit-exact tensor comparison for round trips (imported inside ranks)."""

from __future__ import annotations


def max_abs_delta(expected, got) -> float:
    """The largest absolute difference between two tensors; ``inf`` when their shapes differ
    (a rank that loaded another layout did not load what it saved); 0.0 for two empty tensors."""
    if tuple(expected.shape) != tuple(got.shape):
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    return float((expected.detach().cpu().double() - got.detach().cpu().double()).abs().max())
