"""Applying one target through its fix's patcher, and rolling back exactly what failed."""

from __future__ import annotations

from .patching import Patcher


def apply_target(patcher: Patcher, target, module):
    """Run ``target.apply`` on ``module``: None when it went in, else why not. A target that raises
    halfway leaves nothing behind: the changes it made are undone, those of the fix's other
    targets stay."""
    mark = len(patcher.records)
    try:
        target.apply(module, patcher)
    except Exception as exc:
        partial = Patcher(patcher.fix_id)
        partial.records = patcher.records[mark:]
        del patcher.records[mark:]
        partial.revert(whole=False)
        return f"patch raised {type(exc).__name__}: {exc}"
    return None


def revert_all(patchers: dict, fix_ids) -> dict:
    """Take out the layers of ``fix_ids``; returns what late ``from x import f`` bindings must be
    pointed back at (one sweep for all of them: :func:`.patching.unbind_late_imports`)."""
    restore = {}
    for fix_id in fix_ids:
        patcher = patchers.pop(fix_id, None)
        if patcher is not None:
            restore.update(patcher.revert(sweep=False))
    return restore
