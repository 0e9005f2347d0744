"""selftest, rendering: the table a user reads (``--json`` prints the entries as they are)."""

from __future__ import annotations

import mcore_ckpt_fixes

from .selftest_judge import passes


def yes_no(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def deltas(values) -> str:
    return ", ".join("crash" if d is None else f"{d:g}" for d in values)


VERDICT_TEXT = {
    "pass": "PASS: round trip exact with the fix on",
    "fail": "FAIL: a round trip is not exact with the fix on",
    "skipped": "NOT VERIFIED: scenarios skipped on this stack",
    "unverified": "NOT VERIFIED: no round-trip scenario registered for this fix",
    "not-needed": "not needed by this release",
    "not-applicable": "not applicable: the feature it fixes is absent from this release",
}


OBSERVED_MAX = 300


def shorten(text: str) -> str:
    """One table cell: a bug seen on several ranks can list dozens of keys; --json keeps it whole."""
    if len(text) <= OBSERVED_MAX:
        return text
    return text[: OBSERVED_MAX - 1].rstrip() + "… (whole text: --json)"


def verdict_text(e) -> str:
    """The verdict, with what it does not decide but a reader must not miss."""
    text = VERDICT_TEXT[e["verdict"]]
    ran = [s for s in e["scenarios"] if s["exact"] is not None]
    not_reproduced = [s["name"] for s in ran if s["reproduced"] is False]
    if e["verdict"] in ("pass", "fail", "skipped") and e["needed"] is not False and ran:
        if not not_reproduced:
            text += "; the documented bug showed with it off"
        else:
            text += f"; the documented bug did NOT show with it off in {', '.join(not_reproduced)}"
    if e["verdict"] == "not-needed":
        broken = [s["name"] for s in ran if s["exact"] is False]
        still = [s["name"] for s in ran if s["reproduced"]]
        if still:
            text += f"; yet the documented bug shows with the fix off in {', '.join(still)}"
        if broken:
            text += f"; round trip NOT exact in {', '.join(broken)} (not counted: the fix is not needed)"
        elif ran and not still:
            text += "; round trip exact with the fix off and on"
    return text


def report_header(info, torch_version, device, nproc, only=None) -> str:
    """The report's first line: the stack, and which scenarios were asked for."""
    how = "gloo, forked ranks" if device == "cpu" else "nccl, one GPU per rank"
    return (
        f"mcore-ckpt-fixes {mcore_ckpt_fixes.__version__} selftest: {info.describe()}; "
        f"torch {torch_version}; --device {device} ({how}), "
        + (f"--nproc {nproc}" if nproc is not None else "each scenario at its own world size")
        + (f"; only --fix {','.join(only)}" if only is not None else "")
    )


def print_table(rows, info, torch_version, device, nproc, code, total, only=None) -> None:
    print(report_header(info, torch_version, device, nproc, only))
    pending = [e for e in rows if not e["implemented"]]
    for e in rows:
        if not e["implemented"]:
            continue
        print()
        print(f"{e['id']}: {e['summary']}")
        needed = {True: "yes", False: "no", None: "unknown"}[e["needed"]]
        print(f"  needed by this release: {needed} ({e['state']}; affected {e['affected']})")
        if e["scenarios"]:
            header = (
                "scenario",
                "bug with fix off",
                "exact with fix on",
                "max |delta| per rank",
                "time",
                "observed with the fix off",
            )
            table = []
            for s in e["scenarios"]:
                if s["skipped"] or s.get("error"):
                    what = f"skipped: {s['skipped']}" if s["skipped"] else f"not run: {s['error']}"
                    table.append((s["name"], "-", "-", "-", "-", what))
                    continue
                observed = shorten(s["fix_off"]["observed"])
                if not s["exact"]:  # the failure itself is never shortened
                    observed += f"  | with the fix on: {s['fix_on']['observed']}"
                table.append(
                    (
                        s["name"],
                        yes_no(s["reproduced"]),
                        yes_no(s["exact"]),
                        deltas(s["fix_on"]["max_delta_per_rank"]),
                        f"{s['seconds']:.1f} s",
                        observed,
                    )
                )
            widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header) - 1)]
            for r in [header, *table]:
                print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        print(f"  verdict: {verdict_text(e)} ({e['seconds']:.1f} s)")
    if pending:
        print()
        print("registered, not implemented yet (nothing patched, not checked):")
        width = max(len(e["id"]) for e in pending)
        for e in pending:
            rng = yes_no(e["in_affected_range"])
            print(f"  {e['id']:<{width}}  affected {e['affected']} (this release: {rng}); {e['reason']}")
    print()
    # Name each implemented fix under what was actually established for it: a fix whose feature
    # this release lacks was not checked, and must not be listed as if it had been.
    groups = (("exact", "pass"), ("not needed here", "not-needed"), ("not applicable here", "not-applicable"))
    checked = "; ".join(
        f"{label}: {', '.join(ids)}"
        for label, verdict in groups
        if (ids := [e["id"] for e in rows if e["implemented"] and e["verdict"] == verdict])
    )
    unfixed = [e["id"] for e in pending if e["in_affected_range"]]
    if code == 0 and all(e["needed"] is False for e in rows if e["implemented"]):
        print(f"selftest: PASS in {total:.0f} s: this release needs none of the implemented fixes ({checked})")
    elif code == 0:
        print(
            f"selftest: PASS in {total:.0f} s: every implemented fix this release needs is exact with the "
            f"fix on ({checked})"
        )
    else:
        failing = [e["id"] for e in rows if e["verdict"] == "fail"]
        unverified = [e["id"] for e in rows if not passes(e) and e["verdict"] != "fail"]
        why = ([f"not exact with the fix on: {', '.join(failing)}"] if failing else []) + (
            [f"not verified (skipped, or no round trip): {', '.join(unverified)}"] if unverified else []
        )
        print(f"selftest: FAIL in {total:.0f} s: {'; '.join(why)}")
    if unfixed:
        print(f"not checked, not fixed by this package yet, and in this release's affected range: {', '.join(unfixed)}")
