"""``selftest --resume``: the resume check (:mod:`mcore_ckpt_fixes.resume`) on this stack.

Per configuration, with the fixes at their defaults and with every fix off: exact (the resumed
run is bit for bit the uninterrupted one on every rank), or the first resumed step, the rank and
the state that differ; a configuration of options whose resume is not meant to be exact, as the
release's own resume (the same bits or error) or where it differs. With ``attribution``, each
configuration that needs fixes also runs with only those on. Exit 0 only when every configuration is
exact (or as the release) with the fixes on (and with only its own, where run); 1 when one is not (or
could not run); 2 when the check cannot run here at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time

from mcore_ckpt_fixes.engine.version import detect

from .selftest_run import captured, progress, set_aside_user_flags, stack


def _off_note(cfg_out) -> str:
    off, needed = cfg_out.get("off", {}), cfg_out["needed_here"]
    if cfg_out.get("expect") == "as-release":
        return "the release's own resume, not meant to equal the uninterrupted run"
    if off.get("verdict") == "inexact" and not needed:
        return "unexpected: no fix this configuration needs applies here"
    if off.get("verdict") == "exact" and needed:
        return f"unexpected: {', '.join(needed)} applies here, yet the run resumed exactly without it"
    return f"needs {', '.join(needed)}" if needed else ""


def _progress_text(row) -> str:
    if "not_applicable" in row:
        return "not applicable"
    if "known_bug" in row:
        return f"{row['on']['verdict']} with the fixes (known bug {row['known_bug']})"
    text = f"{row['on']['verdict']} with the fixes, {row['off']['verdict']} without"
    if "only" in row:
        text += f", {row['only']['verdict']} with only {', '.join(row['needs'])}"
    return text


def describe(mode_out) -> str:
    """One line: exact, the error, or where the resumed run first differs; for a run held to the
    release's own resume (``as-release``), the same bits or error as the release, or where it
    differs; for several ways of resuming, how many ended each way (:func:`_print` lists them)."""
    verdict = mode_out["verdict"]
    if "ways" in mode_out:
        counts = {}
        for way in mode_out["ways"]:
            counts[way["verdict"]] = counts.get(way["verdict"], 0) + 1
        return f"{verdict} ({', '.join(f'{v}: {n}' for v, n in counts.items())}, of {len(mode_out['ways'])} ways)"
    if verdict == "as-release" and mode_out["same"] == "error":
        return f"as the release: the same error ({mode_out['error']})"
    if verdict == "error" or "ranks" not in mode_out:
        return f"{'ERROR' if verdict == 'error' else 'DIFFERS from the release'} ({mode_out['error']})"
    if verdict in ("exact", "as-release"):
        n = sum(r["n_compared"] for r in mode_out["ranks"])
        what = "exact" if verdict == "exact" else "as the release, bit for bit"
        return f"{what} ({len(mode_out['ranks'])} ranks, {n} values)"
    bad = [r for r in mode_out["ranks"] if not r["exact"]]
    first = min(bad, key=lambda r: (r["first_step"] is None, r["first_step"] or 0, r["rank"]))
    where = f"step {first['first_step']}" if first["first_step"] is not None else "final state only"
    ranks = ", ".join(f"{r['rank']} (ep {r['ep']}, tp {r['tp']}): {r['n_differ']} values" for r in bad)
    what = "inexact" if verdict == "inexact" else "DIFFERS from the release"
    return f"{what} from {where} on rank {first['rank']}; ranks {ranks}; e.g. {', '.join(first['differ'][:3])}"


def _print_ways(mode_out) -> None:
    for way in mode_out.get("ways", []):
        print(f"      {' '.join(way['args'])}: {describe(way)}")


def _unchanged(verdict) -> str:
    """Run B with the fixes (it saves and trains on, never resumes) against the release's own run."""
    if verdict["verdict"] == "exact":
        return "the run that never resumes is the release's own, bit for bit (" + describe(verdict) + ")"
    return "the fixes changed a run that never resumes: " + describe(verdict)


def _print(rows, info, torch_version, device, total, code) -> None:
    from mcore_ckpt_fixes.resume.check import RESUME_AT, STEPS

    print(
        f"resume check: Megatron-Core {info.version} ({info.source}), torch {torch_version}, {device}; "
        f"{STEPS} steps uninterrupted (the release alone) vs saved after {RESUME_AT} and resumed in new processes"
    )
    for row in rows:
        print(f"  {row['config']}: {row['summary']}")
        if "not_applicable" in row:
            print(f"    not applicable: {row['not_applicable']}")
            continue
        print(f"    fixes on:  {describe(row['on'])}")
        _print_ways(row["on"])
        if "unchanged" in row["on"]:
            print(f"    unchanged: {_unchanged(row['on']['unchanged'])}")
        if "known_bug" in row:
            print(
                f"    known bug {row['known_bug']}, not fixed here yet (see the known-bugs catalogue); "
                "not counted in the verdict"
            )
            continue
        note = _off_note(row)
        print(f"    fixes off: {describe(row['off'])}" + (f"  [{note}]" if note else ""))
        _print_ways(row["off"])
        if "only" in row:
            print(f"    only {', '.join(row['needs'])}: {describe(row['only'])}")
    verdict = (
        "every configuration exact with the fixes on" if code == 0 else "a configuration is not exact with the fixes on"
    )
    if code == 0 and any(row.get("expect") == "as-release" for row in rows):
        verdict += " (or as the release, where the resume is not meant to be exact)"
    if code == 0 and any("only" in row for row in rows):
        verdict += ", and with only the fixes each needs"
    skipped = sum("not_applicable" in row for row in rows)
    if skipped:  # not run is never counted as exact
        verdict += f"; {skipped} not applicable here, not run"
    print(f"{'PASS' if code == 0 else 'FAIL'}: {verdict} ({total:.0f} s)")


def _exact(row) -> bool:
    """Counted in the verdict: exact with the fixes on (and with only its own fixes, where run), or
    for a configuration held to the release's own resume, that resume bit for bit (or its error);
    and the run that never resumes unchanged by them."""
    unchanged = row.get("on", {}).get("unchanged", {"verdict": "exact"})
    return unchanged["verdict"] == "exact" and all(
        row[mode]["verdict"] in ("exact", "as-release") for mode in ("on", "only") if mode in row
    )


def _modes(cfg, known, attribution) -> tuple:
    if known:
        return ("on",)
    return ("on", "off", "only") if attribution and cfg.needs else ("on", "off")


def run(device: str = "cpu", nproc=None, as_json: bool = False, attribution: bool = False, names=None) -> int:
    from mcore_ckpt_fixes.resume import check as resume
    from mcore_ckpt_fixes.resume.configs import KNOWN_BUG, KNOWN_FAILING

    info = detect()
    if info.source == "absent":
        print("mcore-ckpt-fixes selftest: Megatron-Core is not importable in this environment", file=sys.stderr)
        return 2
    try:  # decided before anything heavy is imported
        configs = resume.chosen(names, nproc)
    except ValueError as exc:
        print(f"mcore-ckpt-fixes selftest --resume: {exc}", file=sys.stderr)
        return 2
    if not configs:
        print(
            f"mcore-ckpt-fixes selftest --resume: no configuration runs on {nproc} rank{'s' * (nproc != 1)} or fewer",
            file=sys.stderr,
        )
        return 2
    # The first import of megatron.training: it sends the root logger to what sys.stdout is then
    # (its CustomHandler), and the fixes applied at that import log there. stdout is --json's.
    with contextlib.redirect_stdout(sys.stderr):
        why = resume.not_applicable()
    torch_version, stack_skip = stack(device, None)
    if why or torch_version is None:
        print(f"mcore-ckpt-fixes selftest --resume: not applicable here: {why or stack_skip}", file=sys.stderr)
        return 2
    set_aside = set_aside_user_flags()
    if set_aside:
        progress(
            "selftest --resume: ignoring "
            + ", ".join(f"{k}={v}" for k, v in set_aside.items())
            + ": the fixes run at their defaults (auto) and off",
            "\n",
        )
    import mcore_ckpt_fixes

    began = time.monotonic()
    fd, log_path = tempfile.mkstemp(prefix="mcore-ckpt-fixes-resume-", suffix=".log")
    os.close(fd)
    rows = []
    with captured(log_path):
        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()
        resume.prepare()
        todo = configs + [c for c in KNOWN_FAILING if names is None and c.world <= (nproc or resume.DEFAULT_NPROC)]
        for i, cfg in enumerate(todo, 1):
            progress(f"resume [{i}/{len(todo)}] {cfg.name} ...")
            start = time.monotonic()
            known = KNOWN_BUG.get(cfg.name)
            row = resume.check(cfg, device, modes=_modes(cfg, known, attribution))
            if known:
                row["known_bug"] = known
            rows.append(row)
            progress(f" {_progress_text(row)} ({time.monotonic() - start:.0f} s)", "\n")
    code = 0 if all(_exact(r) for r in rows if "on" in r and "known_bug" not in r) else 1
    if code == 0:
        os.unlink(log_path)
    else:
        progress(f"selftest --resume: what the ranks and Megatron printed is in {log_path}", "\n")
    for row in rows:
        for mode in ("on", "off", "only"):
            out = row.get(mode, {})
            for r in [r for part in [out, *out.get("ways", [])] for r in part.get("ranks", [])]:
                r.pop("differ_all", None)
                r.pop("compared_all", None)
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        _print(rows, info, torch_version, device, time.monotonic() - began, code)
    return code
