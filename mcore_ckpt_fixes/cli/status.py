"""``status``: every registered fix, its state and why, for the Megatron-Core this process sees."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
import warnings

import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.engine.version import detect


def import_targets() -> None:
    """Import the modules enabled fixes wait for, so their states resolve from 'pending'."""
    for fix_id, module in ENGINE.enabled_target_modules():
        if module in sys.modules:
            continue
        try:
            # Megatron's own import-time chatter stays off stdout (the --json output): warnings
            # are silenced, and a logging handler megatron.training installs on import
            # (a stdout StreamHandler on the root logger) is built while stdout is stderr.
            with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as exc:
            ENGINE.mark_unimportable(fix_id, module, f"{type(exc).__name__}: {exc}")


def run(as_json: bool, import_targets_first: bool) -> int:
    if import_targets_first:
        import_targets()
    rows = mcore_ckpt_fixes.report()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    info = detect()
    print(f"mcore-ckpt-fixes {mcore_ckpt_fixes.__version__}; {info.describe()}")
    width = max(len(r["id"]) for r in rows)
    for r in rows:
        print(f"  {r['id']:<{width}}  {r['state']:<14}  {r['reason']}")
    return 0
