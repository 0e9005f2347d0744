"""The table tools/sweep.sh prints: per release, each fix's status and selftest verdict.

    python tools/sweep_table.py OUT_DIR RELEASE ...            # print the table
    python tools/sweep_table.py --record OUT_DIR RELEASE ...   # also record the selftest results

``--record`` merges each release's selftest result (exit status, seconds, the verdict of every fix
it checked, the date) into tools/sweep-selftest.json, which tools/docs.py renders into
docs/releases.md beside the states of tools/expected-status.json.
"""

import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tools", "sweep-selftest.json")
SHORT = {
    "applied": "applied",
    "not-needed": "not-needed",
    "not-applicable": "n/a",
    "failed": "FAILED",
    "pending": "pending",
    "disabled": "disabled",
}
VERDICT = {
    "pass": "PASS",
    "fail": "FAIL",
    "skipped": "skipped",
    "not-needed": "-",
    "not-applicable": "-",
    "unverified": "NOT VERIFIED",
    "unimplemented": "-",
}
# The verdicts a cell shows: the fix was checked on this release (the others say why not in the state).
SHOWN = ("pass", "fail", "unverified")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cell(state, verdict=None):
    """One release x fix cell: the short state, and the selftest verdict where it checked the fix."""
    text = SHORT.get(state, state)
    return text + (f" / {VERDICT[verdict]}" if verdict in SHOWN else "")


def outcome(ended):
    """The selftest column: ``PASS, 10 s`` or ``FAIL (exit 1), 12 s``; ``-`` when it did not run."""
    if ended is None:
        return "-"
    return ("PASS" if ended["exit"] == 0 else f"FAIL (exit {ended['exit']})") + f", {ended['seconds']} s"


def _results(out, rel):
    status = _load(os.path.join(out, f"{rel}.status.json")) or []
    selftest = {f["id"]: f.get("verdict") for f in _load(os.path.join(out, f"{rel}.selftest.json")) or []}
    ended = _load(os.path.join(out, f"{rel}.selftest.exit.json"))
    return status, selftest, ended


def record(out, releases, path=RECORD):
    """Merge the selftest results found in ``out`` into ``path`` (releases without one are left as they were)."""
    recorded = _load(path) or {}
    today = datetime.date.today().isoformat()
    for rel in releases:
        _, selftest, ended = _results(out, rel)
        if ended is None:
            continue
        verdicts = {fix: v for fix, v in sorted(selftest.items()) if v in SHOWN}
        recorded[rel] = {"date": today, "exit": ended["exit"], "seconds": ended["seconds"], "verdicts": verdicts}
    with open(path, "w") as f:
        json.dump(recorded, f, indent=1, sort_keys=True)
        f.write("\n")


def main(out, releases):
    rows, fixes = [], None
    for rel in releases:
        status, selftest, ended = _results(out, rel)
        fixes = fixes or [r["id"] for r in status]
        cells = [cell(row["state"], selftest.get(row["id"])) for row in status]
        rows.append(f"| {rel} | " + " | ".join(cells) + f" | {outcome(ended)} |")
    print("| release | " + " | ".join(fixes or []) + " | selftest |")
    print("| --- |" + " --- |" * (len(fixes or []) + 1))
    print("\n".join(rows))


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--record"]:
        args = args[1:]
        record(args[0], args[1:])
    main(args[0], args[1:])
