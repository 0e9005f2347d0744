"""Expert keys in a distributed checkpoint: every global expert index once, no EP-rank collisions.

Two spellings carry a global expert index in the key:

* ``...experts.local_experts.{i}.linear_fc1.weight`` (SequentialMLP, torch_dist), and
* ``...experts.linear_fc1.weight{i}`` (TE grouped GEMM experts; what ``fsdp_dtensor`` checkpoints
  write after ``handle_experts_in_state_dict``).

A single grouped tensor (``...experts.linear_fc1.weight``, no index: all experts in dim 0) is
checked by its shape: dim 0 must be the layer's number of experts (the router's rows, or the
indices of its indexed siblings); fewer means each EP rank wrote its own experts under that one key.

Keys are unique in a checkpoint, so a collision between EP ranks does not show as a duplicate: DCP
keeps one writer of a key and drops the others. It shows as a parameter whose index set is smaller
than its siblings' in the same layer (the expert-keys bug: biases keep their local index, so every
EP rank writes ``bias0..bias{E/ep-1}`` while weights span ``0..E-1``).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Set, Tuple

# One tensor of a rank's experts per GEMM, dim 0 the expert (moe_single_grouped_weight / _bias, 0.18+).
_SINGLE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<param>linear_fc\d\.(?:weight|bias))(?P<suffix>(?:\.\D.*)?)$")
_SEQUENTIAL = re.compile(r"^(?P<prefix>.*\.experts)\.local_experts\.(?P<idx>\d+)\.(?P<param>.+)$")
GROUPED_KEY = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<param>(?:[\w]+\.)*?(?:weight|bias))(?P<idx>\d+)(?P<suffix>(?:\..+)?)$"
)


def _parse(fqn: str):
    m = _SEQUENTIAL.match(fqn)
    if m:
        return m.group("prefix"), m.group("param"), int(m.group("idx")), "local_experts.{i}." + m.group("param")
    m = GROUPED_KEY.match(fqn)
    if m:
        param = m.group("param") + m.group("suffix")
        return m.group("prefix"), param, int(m.group("idx")), m.group("param") + "{i}" + m.group("suffix")
    return None


def _ranges(idx: Iterable[int]) -> str:
    s = sorted(idx)
    out, start, prev = [], None, None
    for v in s:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return "{" + ", ".join(out) + "}"


def check(fqns: Iterable[str]) -> Tuple[str, List[Tuple[str, str]]]:
    """(summary, [(code, message)]) for every expert key among ``fqns``."""
    # layer prefix -> param -> index -> spellings
    seen: Dict[str, Dict[str, Dict[int, List[str]]]] = {}
    n_keys = 0
    for fqn in fqns:
        if ".experts." not in fqn:
            continue
        parsed = _parse(fqn)
        if parsed is None:
            continue
        n_keys += 1
        prefix, param, idx, spelling = parsed
        seen.setdefault(prefix, {}).setdefault(param, {}).setdefault(idx, []).append(spelling)
    findings: List[Tuple[str, str]] = []
    if not seen:
        return "", findings
    counts: Set[int] = set()
    for prefix in sorted(seen):
        params = seen[prefix]
        union: Set[int] = set()
        for param, by_idx in params.items():
            union |= set(by_idx)
            for idx, spellings in by_idx.items():
                if len(spellings) > 1:
                    findings.append(
                        (
                            "expert-duplicate",
                            f"{prefix}: expert {idx} of {param} is stored {len(spellings)} times "
                            f"({', '.join(sorted(spellings))}): a load reads one of them",
                        )
                    )
        n = max(union) + 1
        counts.add(n)
        gaps = set(range(n)) - union
        if gaps:
            findings.append(
                (
                    "expert-missing",
                    f"{prefix}: global expert indices {_ranges(gaps)} are in no key (indices present: {_ranges(union)})",
                )
            )
        for param in sorted(params):
            have = set(params[param])
            lacking = union - have
            if not lacking:
                continue
            local = have == set(range(len(have))) and len(union) % len(have) == 0
            why = (
                f"EP ranks wrote it under their local indices {_ranges(have)}, so {len(union) // len(have)} "
                "ranks wrote the same keys and all but one were dropped (see fix expert-keys)"
                if local
                else "those experts' values are not in the checkpoint"
            )
            findings.append(
                (
                    "expert-key-collision" if local else "expert-missing",
                    f"{prefix}: {param} has experts {_ranges(have)}, its sibling parameters {_ranges(union)}: {why}",
                )
            )
    summary = (
        f"{n_keys} expert keys in {len(seen)} expert blocks, {'/'.join(str(c) for c in sorted(counts))} experts each"
    )
    return summary, findings


def check_single_grouped(sizes: Dict[str, List[int]]) -> Tuple[int, List[Tuple[str, str]]]:
    """(number of single grouped tensors, [(code, message)]) for a checkpoint's tensor shapes."""
    indexed: Dict[str, int] = {}  # expert block (with state suffix) -> experts its indexed keys span
    for fqn in sizes:
        parsed = _parse(fqn) if ".experts." in fqn else None
        if parsed is not None:
            prefix = parsed[0]
            indexed[prefix] = max(indexed.get(prefix, 0), parsed[2] + 1)
    n, findings = 0, []
    for fqn in sorted(sizes):
        m = _SINGLE.match(fqn) if ".experts." in fqn else None
        if m is None or not sizes[fqn]:
            continue
        n += 1
        router = f"{m['prefix'][: -len('.experts')]}.router.weight{m['suffix']}"
        if router in sizes and sizes[router]:
            experts, source = sizes[router][0], f"rows of {router}"
        elif m["prefix"] in indexed:
            experts, source = indexed[m["prefix"]], "indices of its indexed sibling parameters"
        else:
            continue  # nothing in the checkpoint says how many experts the layer has
        if sizes[fqn][0] < experts:
            findings.append(
                (
                    "expert-key-collision",
                    f"{fqn}: one grouped tensor of {sizes[fqn][0]} experts (shape {sizes[fqn]}) where the layer has "
                    f"{experts} ({source}): each EP rank wrote its own experts under this key and one copy was kept "
                    "(an unfixed Megatron-Core under expert parallelism; see fix expert-keys)",
                )
            )
    return n, findings
