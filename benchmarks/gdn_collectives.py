"""gdn-fsdp-split: torch.distributed collectives issued per GDN tensor during save preprocessing
(``handle_gdn_in_state_dict``), the fix vs this release's upstream function.

World 2 (gloo, CPU), the stand-in GDN layer of the gdn-fsdp-split scenarios: 3 fused parameters
(in_proj.weight, conv1d.weight, conv1d.bias), each with exp_avg and exp_avg_sq, so 9 fused tensors
split into 36 pieces. Collectives are counted by wrapping the ``torch.distributed`` functions for the
duration of the call (top-level calls only: the all_gathers inside all_gather_object are not counted
again). A rank whose count differs from another's is the hang signature of #4910.

    PYTHONPATH=$E/mcore-0.19.2:. $E/py3.12/bin/python benchmarks/gdn_collectives.py
"""

import json
import sys

from mcore_ckpt_fixes.testing.launcher import run_world, values

CASES = (  # (tp, layout): the layouts a rank can hold
    (2, "tp_global"),
    (2, "tp_local"),
    (1, "tp_global"),
    (2, "mixed"),
)


def main() -> int:
    from mcore_ckpt_fixes.engine.version import detect
    from mcore_ckpt_fixes.fixes.gdn_fsdp_split.checks.core import prepare

    prepare()
    rows = []
    for tp, layout in CASES:
        for impl in ("current", "upstream"):
            if layout == "mixed" and impl == "upstream":
                continue  # upstream hangs or fails here: nothing to count (see the tests)
            per_rank = values(
                run_world(
                    "mcore_ckpt_fixes.fixes.gdn_fsdp_split.checks.core:count_collectives",
                    2,
                    {"ckpt_dir": "", "patched": True, "tp": tp, "layout": layout, "optimizer": True, "impl": impl},
                    timeout=120,
                )
            )
            r0 = per_rank[0]
            rows.append(
                {
                    "impl": "fix" if impl == "current" else "upstream",
                    "tp": tp,
                    "layout": layout,
                    "per_rank_total": [r["total"] for r in per_rank],
                    "per_gdn_tensor": [round(r["total"] / r["gdn_tensors"], 2) for r in per_rank],
                    "by_name_rank0": r0["counts"],
                    "ms_rank0": round(r0["seconds"] * 1e3, 2),
                    "error": sorted({r["error"] for r in per_rank if r["error"]}) or None,
                }
            )
    print(json.dumps({"megatron_core": str(detect().version), "gdn_tensors": 9, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
