"""selftest, judging: what each rank's result says, and the verdict per fix (no I/O, no torch).

Reads what :mod:`.selftest_run` collected; :mod:`.selftest_render` prints it.
"""

from __future__ import annotations

from ..testing.compare import worst

NEEDED_BY_STATE = {"applied": True, "not-needed": False, "not-applicable": False}


# How a scenario whose feature this release lacks is reported (its ``skipped`` text starts so).
NOT_APPLICABLE = "not applicable to this release: "


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def missing_module(message: str):
    """``"ModuleNotFoundError: No module named 'x'"`` -> the reason to skip, else None."""
    if message and message.startswith("ModuleNotFoundError:"):
        return "missing dependency: " + message.split(":", 1)[1].strip()
    return None


def rank_rows(results):
    rows = []
    for r in results:
        if not r.ok:
            # A rank killed at the deadline: its first line says so (its stack follows); a crash: the
            # traceback's last line says what was raised.
            hung = r.error.startswith(f"rank {r.rank} did not finish")
            line = r.error.split(";")[0] if hung else last_line(r.error)
            rows.append(
                {
                    "rank": r.rank,
                    "ok": False,
                    "error": line,
                    "phase": None,
                    "max_delta": None,
                    "n_tensors": 0,
                    "fix_state": None,
                    "device": None,
                    "traceback": r.error,
                }
            )
            continue
        v = r.value or {}
        deltas = v.get("max_delta") or {}
        rows.append(
            {
                "rank": r.rank,
                "ok": True,
                "error": v.get("error"),
                "phase": v.get("phase"),
                "max_delta": worst(deltas.values()) if deltas else None,
                "n_tensors": v.get("n_tensors", 0),
                "fix_state": v.get("fix_state"),
                "device": v.get("device"),
                "traceback": v.get("traceback"),
                "_value": v,
            }
        )
    return rows


def is_exact(row) -> bool:
    value = row.get("_value")
    return bool(
        row["ok"]
        and value is not None
        and value.get("error") is None
        and row["n_tensors"] > 0
        and all(d == 0.0 for d in value["max_delta"].values())
    )


def describe_ranks(rows) -> str:
    """One observation for all ranks when they agree, else per rank."""

    def one(row):
        if not row["ok"]:
            return f"rank crashed: {row['error']}"
        if row["error"] is not None:
            return f"{row['error']} (in {row['phase']})"
        if is_exact(row):
            return f"round trip exact ({row['n_tensors']} tensor{'s' if row['n_tensors'] != 1 else ''})"
        return f"max |delta| {row['max_delta']:g}" if row["max_delta"] is not None else "no tensors compared"

    seen = [one(r) for r in rows]
    if len(set(seen)) == 1:
        return seen[0]
    return "; ".join(f"rank {r['rank']}: {s}" for r, s in zip(rows, seen))


def skip_missing(rows):
    for row in rows:
        reason = missing_module(row["error"]) if (not row["ok"] or row["phase"] == "build") else None
        if reason:
            return reason
    return None


def expected_off(scenario, needed, version) -> str:
    bug = scenario.bug_for(version) if needed is not False else None
    return bug.describe() if bug is not None else "round trip exact"


def verdict(entry) -> str:
    if not entry["implemented"]:
        return "unimplemented"
    scenarios = entry["scenarios"]
    if not scenarios:
        return "unverified"  # implemented without a round trip: nothing to show it works
    if entry["state"] == "not-applicable":
        return "not-applicable"
    if entry["needed"] is False:
        return "not-needed"
    # A scenario of a feature this release lacks (single grouped experts before 0.18) says nothing
    # about the fix here: the verdict rests on the others, and on at least one of them.
    scenarios = [s for s in scenarios if not (s["skipped"] or "").startswith(NOT_APPLICABLE)]
    if any(s["exact"] is False for s in scenarios):
        return "fail"
    if not scenarios or any(s["skipped"] for s in scenarios):
        return "skipped"
    return "pass"


def passes(entry) -> bool:
    # Unimplemented fixes are not checked (listed as such); a fix this release does not need does
    # not decide the exit status. Everything else must have run every scenario exactly.
    if entry["verdict"] in ("unimplemented", "not-needed", "not-applicable"):
        return True
    return entry["verdict"] == "pass"
