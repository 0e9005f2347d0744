"""Child of tests/engine/test_all_fixes.py: every fix applied at once (every target module imported,
as ``status`` does), then reverted; prints, as JSON, each fix's state, what each applied fix
recorded, and every recorded attribute that does not hold its original object after the revert."""

import json

if __name__ == "__main__":
    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.cli.status import import_targets
    from mcore_ckpt_fixes.engine.patching import MISSING, is_replacement
    from mcore_ckpt_fixes.engine.registry import ENGINE

    import_targets()
    states = {r["id"]: r["state"] for r in mcore_ckpt_fixes.report()}
    records = {f: list(ENGINE.changes(f)) for f, s in states.items() if s == "applied"}
    mcore_ckpt_fixes.revert()
    left = []
    for fix_id, recs in records.items():
        for rec in recs:
            now = rec.owner.__dict__.get(rec.name, MISSING)
            if now is not rec.before or is_replacement(now):
                left.append(f"{fix_id}: {getattr(rec.owner, '__name__', rec.owner)}.{rec.name}")
    out = {
        "states": states,
        "changes": {f: len(r) for f, r in records.items()},
        "not_restored": left,
    }
    print(json.dumps(out))
