"""Bit-for-bit comparison of a resumed run with the uninterrupted one, per rank.

"Equal" means the same bytes: tensors of the same dtype and shape with identical storage bytes (a
NaN equals only the same NaN), floats with the same IEEE bits, everything else by type and value,
recursively. Nothing is rounded and nothing is skipped: a name present in one run only differs.
"""

from __future__ import annotations

import struct

import numpy as np

SHOWN = 8  # names listed per rank in a verdict; the count says how many differ in all


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def differing(expected: dict, got: dict) -> list:
    """Names whose values are not the same (a name in only one of the two included)."""
    return sorted(
        k for k in set(expected) | set(got) if k not in expected or k not in got or not same(expected[k], got[k])
    )


def rank_verdict(uninterrupted: dict, resumed: dict) -> dict:
    """One rank: the resumed steps whose loss differs, and the final state entries that differ."""
    steps = sorted(resumed["losses"])
    bad_steps = [s for s in steps if not same(uninterrupted["losses"].get(s), resumed["losses"][s])]
    names = differing(uninterrupted["state"], resumed["state"])
    return {
        **resumed["coords"],
        "exact": not bad_steps and not names,
        "steps": steps,
        "first_step": bad_steps[0] if bad_steps else None,
        "losses_differ": bad_steps,
        "n_differ": len(names),
        "differ": names[:SHOWN],
        "differ_all": names,
        "n_compared": len(resumed["state"]) + len(steps),
        "compared_all": sorted(resumed["state"]),
        "load_warnings": list(resumed.get("load_warnings", [])),
        "iteration": resumed.get("iteration"),  # what load_checkpoint returned (run C only)
    }


def release_rank_verdict(release: dict, fixed: dict) -> dict:
    """One rank of a resume whose result is not meant to equal the uninterrupted run (the optimizer
    or RNG not loaded, ``--finetune``), with the fixes (``fixed``) against the release's own resume
    (``release``, the same run without them): ``exact`` means the same bits, every resumed loss and
    state entry as :func:`rank_verdict` compares them, and the iteration ``load_checkpoint``
    returned (``load:iteration`` among the names that differ otherwise)."""
    verdict = rank_verdict(release, fixed)
    if not same(release.get("iteration"), fixed.get("iteration")):
        names = sorted(verdict["differ_all"] + ["load:iteration"])
        verdict.update(exact=False, n_differ=len(names), differ=names[:SHOWN], differ_all=names)
    return verdict
