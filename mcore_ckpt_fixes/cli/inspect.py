"""``inspect``: the checkpoint doctor on the command line (see mcore_ckpt_fixes.doctor)."""

from __future__ import annotations

import json
import sys
from typing import Optional


def run(
    path: str,
    tp: Optional[int],
    pp: Optional[int],
    ep: Optional[int],
    iteration: Optional[int],
    as_json: bool,
    verify_hashes: bool = False,
) -> int:
    from mcore_ckpt_fixes.doctor import Unreadable, inspect
    from mcore_ckpt_fixes.doctor.remedies import for_code

    try:
        report = inspect(path, tp=tp, pp=pp, ep=ep, iteration=iteration, verify_hashes=verify_hashes)
    except Unreadable as exc:
        line = f"mcore-ckpt-fixes inspect: {exc}"
        if as_json:  # tools still get an object on stdout
            print(
                json.dumps(
                    {
                        "path": path,
                        "format": "unknown",
                        "iteration": iteration,
                        "error": str(exc),
                        "problems": [{"code": "unreadable", "message": str(exc), "remedy": for_code("unreadable")}],
                    },
                    indent=2,
                )
            )
        print(line, file=sys.stderr)
        return 2
    except Exception as exc:  # a doctor bug: still one line, never a traceback in the user's face
        print(
            f"mcore-ckpt-fixes inspect: internal error reading {path}: {type(exc).__name__}: {exc} "
            "(please report this with the checkpoint's file listing)",
            file=sys.stderr,
        )
        return 2
    code = 1 if report.problems else 0
    try:
        print(report.to_json() if as_json else report.render())
        sys.stdout.flush()
    except BrokenPipeError:  # `inspect ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code
