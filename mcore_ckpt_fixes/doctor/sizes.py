"""The run's sizes (tp, pp, ep): given on the command line, or else what the checkpoint's own saved
args record. A user resuming a run passes no sizes to the doctor: the saved ones are what the resume
will use, so a finding that depends on them (the old RNG layout under EP) must not wait for a flag.
The args are read with the allow-list unpickler only (see files); nothing in them is run."""

from __future__ import annotations

from typing import Dict, Optional

ARG_NAMES = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size",
}


def from_args(args) -> Dict[str, Optional[int]]:
    """{tp, pp, ep} from a saved args Namespace (its stand-in); None where absent or not a size."""
    out = {}
    for short, long in ARG_NAMES.items():
        value = getattr(args, long, None)
        out[short] = value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None
    return out


def resolve(report, given: Dict[str, Optional[int]], args, where: Optional[str]) -> Dict[str, Optional[int]]:
    """The sizes to check against (flags first, then the saved args), recorded in ``report['sizes']``."""
    saved = from_args(args) if args is not None else {}
    used, table = {}, {}
    for dim in ARG_NAMES:
        if given.get(dim) is not None:
            used[dim], source = given[dim], "given"
        elif saved.get(dim) is not None:
            used[dim], source = saved[dim], f"saved args in {where}"
        else:
            used[dim], source = None, "unknown"
        table[dim] = {"used": used[dim], "source": source, "saved": saved.get(dim)}
    report["sizes"] = table
    return used
