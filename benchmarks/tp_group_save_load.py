"""tp-group: sharded_state_dict + save + load time with the fix applied vs reverted, one run.

World 2 (TP=2, gloo, CPU), the MambaMixer and RADIOViTModel of the tp-group scenarios built the
classic way (parallel_state), because unpatched the explicit-group models cannot save at all.
Interleaved repeats (default 15), medians per rank, ratio = patched / unpatched (goal: at most 1.02).

    PYTHONPATH=.envs/mcore-0.18.2:. .envs/py3.12/bin/python benchmarks/tp_group_save_load.py
"""

import json
import sys
import tempfile

from mcore_ckpt_fixes.testing.launcher import run_world, values
from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in


def main() -> int:
    install_mamba_ssm_stand_in()
    import megatron.core.dist_checkpointing  # noqa: F401  (warm parent: ranks fork from here)
    import megatron.core.models.vision.radio  # noqa: F401
    import megatron.core.ssm.mamba_mixer  # noqa: F401
    from mcore_ckpt_fixes.engine.version import detect

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15  # fewer repeats: +-8 % noise here
    with tempfile.TemporaryDirectory() as d:
        per_rank = values(
            run_world(
                "mcore_ckpt_fixes.fixes.tp_group.checks.classic_models:save_load_timing",
                2,
                {"ckpt_dir": d, "repeats": repeats},
                timeout=600,
            )
        )
    out = {
        "megatron_core": str(detect().version),
        "repeats": repeats,
        "per_rank": per_rank,
        "ratio_patched_over_unpatched": round(max(r["patched_s"] / r["unpatched_s"] for r in per_rank), 4),
        "goal_at_most": 1.02,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
