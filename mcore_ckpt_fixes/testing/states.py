"""The fix state a round trip must run under (imported inside ranks; nothing heavy at import)."""

from __future__ import annotations

ON = ("applied", "not-needed")


def fix_states(fix_id: str, modules, patched: bool, accept=ON) -> dict:
    """``{module: state}`` of ``fix_id`` for the target modules a scenario uses, as selftest reads
    it, after asserting that it matches ``patched``: a world started with the wrong flags must not
    pass as "fixed" (on a release that does not need the fix, both halves round-trip alike)."""
    import mcore_ckpt_fixes

    row = next(r for r in mcore_ckpt_fixes.report() if r["id"] == fix_id)
    states = {m: row["targets"].get(m, {}).get("state", row["state"]) for m in modules}
    if patched:
        assert all(s in accept for s in states.values()), f"{fix_id} expected on: {states}: {row['reason']}"
    else:
        assert row["state"] == "disabled", f"{fix_id} expected off, is {row['state']}: {row['reason']}"
    return states
