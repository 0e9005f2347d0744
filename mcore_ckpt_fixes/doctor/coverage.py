"""Do a tensor's chunks cover it exactly: every element in one chunk, none in two, none outside?

A sweep, not a pairwise comparison: chunks are sorted along one dimension and grouped into runs that
overlap there; a run whose chunks all span the same interval (the slabs of a regular TP/EP/DP grid)
is checked recursively in the next dimension, and the holes between runs are the gaps. Only a run of
chunks with different extents (an irregular split) falls back to a sweep with an active list, so a
regular grid of n chunks costs O(n log n) whatever its shape.
"""

from __future__ import annotations

from math import prod
from operator import itemgetter
from typing import List, Sequence, Tuple

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)
MAX_FINDINGS = 4  # per tensor: enough to see the pattern, not a wall of text


def _fmt(region) -> str:
    return "[" + ", ".join(f"{lo}:{hi}" for lo, hi in region) + "]"


def check(shape: Sequence[int], chunks: Sequence[Box]) -> List[Tuple[str, str]]:
    """``[(kind, detail)]`` with kind in gap, overlap, out-of-bounds, bad-chunk; empty when exact."""
    shape = tuple(int(s) for s in shape)
    nd = len(shape)
    if nd and _is_grid(shape, chunks):
        return []
    findings: List[Tuple[str, str]] = []
    boxes: List[Box] = []
    for off, size in chunks:
        if type(off) is not tuple or type(size) is not tuple:
            off, size = tuple(off), tuple(size)
        if len(off) != nd or len(size) != nd:
            findings.append(
                ("bad-chunk", f"chunk at {list(off)} of size {list(size)} has the wrong rank for shape {list(shape)}")
            )
            continue
        for o, s, d in zip(off, size, shape):
            if o < 0 or s < 0 or o + s > d:
                findings.append(
                    (
                        "out-of-bounds",
                        f"chunk {_fmt(zip(off, (o + s for o, s in zip(off, size))))} "
                        f"reaches outside shape {list(shape)}",
                    )
                )
                break
            if s == 0:  # an empty local shard covers nothing and overlaps nothing
                break
        else:
            boxes.append((off, size))
    if nd == 0:
        if not boxes:
            findings.append(("gap", "the scalar is in no chunk"))
        elif len(boxes) > 1:
            findings.append(("overlap", f"the scalar is written by {len(boxes)} chunks"))
        return findings
    if prod(shape) == 0:
        return findings
    _sweep(boxes, 0, shape, [], findings)
    return findings[: MAX_FINDINGS + 1]


def _is_grid(shape, chunks) -> bool:
    """Exact cover by a regular grid, the layout of every TP/EP/DP split, decided with C loops only:
    along each dimension the distinct (offset, size) pairs tile it end to end (so an offset fixes
    the size), and the chunks' offset tuples are distinct and as many as the grid's cells (so they
    are the grid's cells, each once). Anything else (and any error) is left to the sweep."""
    try:
        n = len(chunks)
        if n == 0:
            return False
        offs = list(map(itemgetter(0), chunks))
        sizes = list(map(itemgetter(1), chunks))
        if set(map(len, offs)) != {len(shape)} or set(map(len, sizes)) != {len(shape)}:
            return False
        if len(set(offs)) != n:
            return False
        cells = 1
        for d, dim in enumerate(shape):
            pos = 0
            pairs = sorted(set(zip(map(itemgetter(d), offs), map(itemgetter(d), sizes))))
            for o, s in pairs:
                if o != pos or s <= 0 or type(o) is not int or type(s) is not int:
                    return False
                pos = o + s
            if pos != dim:
                return False
            cells *= len(pairs)
        return cells == n
    except (TypeError, ValueError, IndexError):
        return False


def _sweep(boxes: List[Box], d: int, shape, prefix, findings) -> None:
    if len(findings) > MAX_FINDINGS:
        return
    nd = len(shape)
    if d == nd:
        if len(boxes) > 1:
            findings.append(("overlap", f"region {_fmt(prefix)} is written by {len(boxes)} chunks"))
        return
    # Plain tuple order: within a slab the earlier offsets are all equal, so this sorts by offset d
    # (and costs no key function per chunk).
    boxes.sort()
    runs: List[List[Box]] = []
    run_end = None
    for b in boxes:
        start = b[0][d]
        if run_end is None or start >= run_end:
            runs.append([b])
            run_end = start + b[1][d]
        else:
            runs[-1].append(b)
            run_end = max(run_end, start + b[1][d])
    rest = [(0, s) for s in shape[d + 1 :]]
    pos = 0
    for run in runs:
        lo = run[0][0][d]
        hi = run[0][0][d] + run[0][1][d] if len(run) == 1 else max(b[0][d] + b[1][d] for b in run)
        if lo > pos:
            findings.append(("gap", f"region {_fmt(prefix + [(pos, lo)] + rest)} is in no chunk"))
        pos = hi
        first = run[0]
        if len(run) == 1:  # one chunk spans this slab: it must span every later dimension whole
            _single(first, d + 1, shape, prefix + [(lo, hi)], findings)
        elif d == nd - 1 and all(b[0][d] == lo and b[1][d] == first[1][d] for b in run):
            findings.append(("overlap", f"region {_fmt(prefix + [(lo, hi)])} is written by {len(run)} chunks"))
        elif all(b[0][d] == lo and b[1][d] == first[1][d] for b in run):
            _sweep(run, d + 1, shape, prefix + [(lo, hi)], findings)
        else:
            _irregular(run, d, shape, prefix, (lo, hi), findings)
        if len(findings) > MAX_FINDINGS:
            return
    if pos < shape[d]:
        findings.append(("gap", f"region {_fmt(prefix + [(pos, shape[d])] + rest)} is in no chunk"))


def _single(box: Box, d: int, shape, prefix, findings) -> None:
    off, size = box
    for k in range(d, len(shape)):
        if off[k] != 0 or size[k] != shape[k]:
            rest = [(0, s) for s in shape[k + 1 :]]
            span = [(off[j], off[j] + size[j]) for j in range(d, k)]
            if off[k] > 0:
                findings.append(("gap", f"region {_fmt(prefix + span + [(0, off[k])] + rest)} is in no chunk"))
            if off[k] + size[k] < shape[k]:
                findings.append(
                    ("gap", f"region {_fmt(prefix + span + [(off[k] + size[k], shape[k])] + rest)} is in no chunk")
                )
            return


def _irregular(run: List[Box], d: int, shape, prefix, span, findings) -> None:
    """Chunks of different extents along ``d``: pairwise only against those still open (active list)."""
    active: List[Box] = []
    overlapped = False
    for b in run:  # sorted by start along d
        start = b[0][d]
        active = [a for a in active if a[0][d] + a[1][d] > start]
        for a in active:
            if all(max(a[0][k], b[0][k]) < min(a[0][k] + a[1][k], b[0][k] + b[1][k]) for k in range(d + 1, len(shape))):
                region = [
                    (max(a[0][k], b[0][k]), min(a[0][k] + a[1][k], b[0][k] + b[1][k])) for k in range(d, len(shape))
                ]
                findings.append(("overlap", f"region {_fmt(prefix + region)} is written by more than one chunk"))
                overlapped = True
                if len(findings) > MAX_FINDINGS:
                    return
        active.append(b)
    if not overlapped:  # disjoint: the volumes tell whether the span is filled
        inner = prod(shape[d + 1 :])
        covered = sum(prod(b[1][d:]) for b in run)
        if covered < (span[1] - span[0]) * inner:
            missing = (span[1] - span[0]) * inner - covered
            findings.append(
                (
                    "gap",
                    f"{missing} elements of region {_fmt(prefix + [span] + [(0, s) for s in shape[d + 1 :]])} "
                    "are in no chunk",
                )
            )
