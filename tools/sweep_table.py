"""The table tools/sweep.sh prints: per release, each fix's status and selftest verdict.

    python tools/sweep_table.py OUT_DIR RELEASE ...
"""

import json
import os
import sys

SHORT = {"applied": "applied", "not-needed": "not-needed", "not-applicable": "n/a", "failed": "FAILED",
         "pending": "pending", "disabled": "disabled"}
VERDICT = {"pass": "PASS", "fail": "FAIL", "skipped": "skipped", "not-needed": "-", "not-applicable": "-",
           "unverified": "NOT VERIFIED", "unimplemented": "-"}


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(out, releases):
    rows, fixes = [], None
    for rel in releases:
        status = _load(os.path.join(out, f"{rel}.status.json")) or []
        selftest = {f["id"]: f for f in _load(os.path.join(out, f"{rel}.selftest.json")) or []}
        ended = _load(os.path.join(out, f"{rel}.selftest.exit.json"))
        fixes = fixes or [r["id"] for r in status]
        cells = []
        for row in status:
            cell = SHORT.get(row["state"], row["state"])
            verdict = selftest.get(row["id"], {}).get("verdict")
            if verdict in ("pass", "fail", "unverified"):
                cell += f" / {VERDICT[verdict]}"
            cells.append(cell)
        overall = "-" if ended is None else ("PASS" if ended["exit"] == 0 else f"FAIL (exit {ended['exit']})") + f", {ended['seconds']} s"
        rows.append(f"| {rel} | " + " | ".join(cells) + f" | {overall} |")
    print("| release | " + " | ".join(fixes or []) + " | selftest |")
    print("| --- |" + " --- |" * (len(fixes or []) + 1))
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
