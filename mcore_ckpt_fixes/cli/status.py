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
    """Import the modules enabled fixes wait for, so their states resolve from 'pending'. A
    framework that is not installed is not imported (it is reported not-applicable)."""
    for fix_id, module in ENGINE.enabled_target_modules(installed_only=True):
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


WIDTH = 100  # columns of the text output; --json keeps every reason whole
MAX_LINES = 4  # lines of one reason in the text output


def wrap_reason(reason: str, indent: int) -> list:
    """``reason`` in lines that fit WIDTH after ``indent`` columns, at most MAX_LINES of them. Words
    stay whole (a dotted module path or a fix id longer than the column overruns it rather than
    being cut mid-name, which a reader cannot search for)."""
    import textwrap

    lines = textwrap.wrap(reason, max(40, WIDTH - indent), break_on_hyphens=False, break_long_words=False) or [""]
    if len(lines) > MAX_LINES:
        more = " [... whole: --json]"
        lines = lines[:MAX_LINES]
        lines[-1] = textwrap.shorten(lines[-1], max(40, WIDTH - indent) - len(more), placeholder="") + more
    return lines


def run(as_json: bool, import_targets_first: bool, known_bugs: bool = False) -> int:
    if known_bugs:
        return run_known_bugs(as_json, import_targets_first)
    if import_targets_first:
        import_targets()
    rows = mcore_ckpt_fixes.report()
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    info = detect()
    print(f"mcore-ckpt-fixes {mcore_ckpt_fixes.__version__}; {info.describe()}")
    width = max(len(r["id"]) for r in rows)
    indent = 2 + width + 2 + 14 + 2  # where a reason starts; its next lines start there too
    for r in rows:
        first, *rest = wrap_reason(r["reason"], indent)
        print(f"  {r['id']:<{width}}  {r['state']:<14}  {first}")
        for line in rest:
            print(" " * indent + line)
        targets = r["targets"]
        mixed = len({t["state"] for t in targets.values()}) > 1
        if r["state"] != "disabled" and (mixed or any(t["package"] != "megatron-core" for t in targets.values())):
            # Every binding the fix covers in this process (Megatron's modules, frameworks' copies).
            for module, target in targets.items():
                print(f"  {'':<{width}}    {module} ({target['package']}): {target['state']}")
    bugs = _catalogue()
    if bugs is None:
        return 1
    from mcore_ckpt_fixes.known_bugs import status_line
    from mcore_ckpt_fixes.other_patches import status_lines

    import textwrap

    for line in status_lines(bugs, {r["id"]: r["state"] for r in rows}):
        print("\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="      ", break_on_hyphens=False)))
    print(status_line(info.version, bugs, _probed(info, rows)))
    return 0


def _probed(info, rows):
    """On a source checkout, each fix's state: there the probes, not the version string, say which
    catalogued bugs the tree has (None on a release wheel)."""
    if info.source != "checkout":
        return None
    return {r["id"]: r["state"] for r in rows}


def _catalogue():
    """The known-bugs catalogue, or None after one line on stderr when it is malformed (an edited
    installation): the fixes' states above it are still printed."""
    from mcore_ckpt_fixes.known_bugs import KnownBugsError, load

    try:
        return load()
    except (KnownBugsError, OSError) as exc:
        print(f"mcore-ckpt-fixes: {exc}", file=sys.stderr)
        return None


def run_known_bugs(as_json: bool, import_targets_first: bool = True) -> int:
    """``status --known-bugs``: the catalogued bugs that affect this release (all of them when no
    Megatron-Core is found), with the count per status."""
    from mcore_ckpt_fixes import known_bugs

    import mcore_ckpt_fixes

    info = detect()
    version = info.version
    bugs = _catalogue()
    if bugs is None:
        return 1
    probed = None
    if version is not None and info.source == "checkout":
        if import_targets_first:  # the probes decide on a checkout: let them run
            import_targets()
        probed = _probed(info, mcore_ckpt_fixes.report())
    shown = bugs if version is None else known_bugs.affecting(version, bugs, probed)
    if as_json:
        from mcore_ckpt_fixes import other_patches

        counts = None if version is None else known_bugs.summary(version, bugs, probed)
        states = {r["id"]: r["state"] for r in mcore_ckpt_fixes.report()}
        out = {
            "megatron_core": None if version is None else str(version),
            "catalogued": len(bugs),
            "summary": counts,
            "bugs": shown,
            # The patches of other packages in this process that turn catalogued bugs silent
            # (`status` prints them as "other patch layers"); `status --json` stays a list of fixes.
            "other_patches": other_patches.as_json(bugs, states),
        }
        print(json.dumps(out, indent=2))
        return 0
    print(known_bugs.status_line(version, bugs, probed))
    width = max((len(b["id"]) for b in shown), default=0)
    for b in shown:
        fix = f" by {b['fix']}" if "fix" in b else ""
        print(f"  {b['id']:<{width}}  {b['status']}{fix}{'  (silent)' if b['silent'] else ''}")
    return 0
