"""``selftest``: run every fix's round trips on this stack, with the fix off and on, and say what happened.

For each registered fix: whether this release needs it (the engine's verdict with default flags,
as ``status`` shows it), then per scenario its fix declares (:mod:`mcore_ckpt_fixes.testing`) one world with the
fix off (``MCORE_CKPT_FIXES=off``: on a release that needs the fix the documented bug must show)
and one with it on (every tensor must come back exactly on every rank). Exit 0 only when every
fix this release needs (or might need: its state could not be decided) has run every scenario
exactly with the fix on; a skipped scenario is never a pass. Fixes registered but not implemented
yet are listed as such and are not checked.

``--device cpu``: gloo worlds of ranks forked from this (warm) process, with the CPU shims applied
in the ranks only. ``--device cuda``: NCCL worlds of spawned workers, one GPU per rank. The CUDA
path has not been run on a GPU by this project's CI (its hosts have none): it is written to the
same contract, and says what it skipped and why.

The user's ``MCORE_CKPT_FIX*`` flags are set aside here (and said so): the selftest compares each
fix at its default (``auto``) with the fix off, whatever this shell has set.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time

import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine import flags as _flags
from mcore_ckpt_fixes.engine.registry import ENGINE
from mcore_ckpt_fixes.engine.version import detect

_NEEDED_BY_STATE = {"applied": True, "not-needed": False, "not-applicable": False}


# -- running ---------------------------------------------------------------------------------------


_PROGRESS_FD = 2  # the terminal's stderr, kept while fds 1 and 2 point at the log (see _captured)


def _progress(text: str, end: str = "") -> None:
    os.write(_PROGRESS_FD, (text + end).encode("utf-8", "replace"))


@contextlib.contextmanager
def _captured(log_path: str):
    """Send fds 1 and 2 to ``log_path`` while the worlds run: ranks (forked or spawned) share our
    file descriptors, and Megatron's warnings from every rank would bury the progress lines and
    corrupt ``--json``. Progress keeps writing to a duplicate of the original stderr."""
    global _PROGRESS_FD
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    _PROGRESS_FD = saved[1]
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        _PROGRESS_FD = 2


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _missing_module(message: str):
    """``"ModuleNotFoundError: No module named 'x'"`` -> the reason to skip, else None."""
    if message and message.startswith("ModuleNotFoundError:"):
        return "missing dependency: " + message.split(":", 1)[1].strip()
    return None


def _rank_rows(results):
    rows = []
    for r in results:
        if not r.ok:
            # A rank killed at the deadline: its first line says so (its stack follows); a crash: the
            # traceback's last line says what was raised.
            hung = r.error.startswith(f"rank {r.rank} did not finish")
            line = r.error.split(";")[0] if hung else _last_line(r.error)
            rows.append({"rank": r.rank, "ok": False, "error": line, "phase": None,
                         "max_delta": None, "n_tensors": 0, "fix_state": None, "device": None,
                         "traceback": r.error})
            continue
        v = r.value or {}
        deltas = v.get("max_delta") or {}
        rows.append({
            "rank": r.rank,
            "ok": True,
            "error": v.get("error"),
            "phase": v.get("phase"),
            "max_delta": max(deltas.values()) if deltas else None,
            "n_tensors": v.get("n_tensors", 0),
            "fix_state": v.get("fix_state"),
            "device": v.get("device"),
            "traceback": v.get("traceback"),
            "_value": v,
        })
    return rows


def _exact(row) -> bool:
    value = row.get("_value")
    return bool(
        row["ok"] and value is not None and value.get("error") is None and row["n_tensors"] > 0
        and all(d == 0.0 for d in value["max_delta"].values())
    )


def _describe_ranks(rows) -> str:
    """One observation for all ranks when they agree, else per rank."""
    def one(row):
        if not row["ok"]:
            return f"rank crashed: {row['error']}"
        if row["error"] is not None:
            return f"{row['error']} (in {row['phase']})"
        if _exact(row):
            return f"round trip exact ({row['n_tensors']} tensor{'s' if row['n_tensors'] != 1 else ''})"
        return f"max |delta| {row['max_delta']:g}" if row["max_delta"] is not None else "no tensors compared"

    seen = [one(r) for r in rows]
    if len(set(seen)) == 1:
        return seen[0]
    return "; ".join(f"rank {r['rank']}: {s}" for r, s in zip(rows, seen))


def _world(scenario, patched, device, nproc, run_world):
    backend, method = ("gloo", "fork") if device == "cpu" else ("nccl", "spawn")
    env = {_flags.GLOBAL_VAR: "auto" if patched else "off"}
    ckpt_dir = tempfile.mkdtemp(prefix="mcore-ckpt-fixes-selftest-")
    start = time.monotonic()
    try:
        results = run_world(
            scenario.func,
            nproc,
            {"ckpt_dir": ckpt_dir, "patched": patched, "device": device},
            env=env,
            timeout=scenario.timeout,
            backend=backend,
            method=method,
        )
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return _rank_rows(results), time.monotonic() - start


def _skip_missing(rows):
    for row in rows:
        reason = _missing_module(row["error"]) if (not row["ok"] or row["phase"] == "build") else None
        if reason:
            return reason
    return None


# How a scenario whose feature this release lacks is reported (its ``skipped`` text starts so).
NOT_APPLICABLE = "not applicable to this release: "


def _expected_off(scenario, needed, version) -> str:
    bug = scenario.bug_for(version) if needed is not False else None
    return bug.describe() if bug is not None else "round trip exact"


def _run_scenario(scenario, needed, device, nproc, run_world, version=None):
    """Both halves of one scenario -> its JSON object (the static skip checks are the caller's)."""
    out = {"skipped": None, "reproduced": None, "exact": None}
    _progress("fix off ... ")
    off, t_off = _world(scenario, False, device, nproc, run_world)
    out["seconds"] = round(t_off, 1)
    missing = _skip_missing(off)
    if missing:  # both halves would stop at the same import
        out["skipped"] = missing
        _progress(f"skipped: {missing}", "\n")
        return out

    bug = scenario.bug_for(version) if needed is not False else None
    if bug is not None and bug.seen_in([r.get("_value") for r in off]):
        outcome, word = "documented-bug", "documented bug reproduced"
    elif all(_exact(r) for r in off):
        outcome, word = "exact", "round trip exact"
    elif not all(r["ok"] for r in off):
        outcome, word = "crashed", "failed otherwise: " + _describe_ranks(off)
    else:
        outcome, word = "other-failure", "failed otherwise: " + _describe_ranks(off)
    out["reproduced"] = outcome == "documented-bug"
    out["fix_off"] = {
        "outcome": outcome,
        "observed": _describe_ranks(off),
        "seconds": round(t_off, 1),
        # The documented failure's traceback says nothing new: keep tracebacks of surprises only.
        "ranks": [_public(r, keep_traceback=outcome != "documented-bug") for r in off],
    }
    _progress(f"{word} ({t_off:.1f} s); fix on ... ")

    on, t_on = _world(scenario, True, device, nproc, run_world)
    out["seconds"] = round(t_off + t_on, 1)
    missing = _skip_missing(on)
    if missing:
        out.update(skipped=missing, reproduced=None)
        _progress(f"skipped: {missing}", "\n")
        return out
    exact = all(_exact(r) for r in on)
    note = None
    states = [r["fix_state"] for r in on if r["ok"] and r["fix_state"]]
    if exact and needed is True and not all(set(s.values()) == {"applied"} for s in states):
        exact, note = False, f"round trip exact, but the fix was not applied in every rank: {states}"
    out["exact"] = exact
    out["fix_on"] = {
        "observed": note or _describe_ranks(on),
        "max_delta_per_rank": [r["max_delta"] for r in on],
        "n_tensors_per_rank": [r["n_tensors"] for r in on],
        "fix_state_per_rank": [r["fix_state"] for r in on],
        "seconds": round(t_on, 1),
        "ranks": [_public(r) for r in on],
    }
    _progress(f"{'exact' if exact else 'NOT EXACT'} ({t_on:.1f} s)", "\n")
    return out


def _public(row, keep_traceback=True):
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    if out.get("error") is None or not keep_traceback:
        out.pop("traceback", None)
    return out


# -- stack checks ----------------------------------------------------------------------------------


def _stack(device, nproc):
    """(torch version or None, reason every scenario must be skipped or None)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return None, f"torch is not importable: {exc}"
    if not dist.is_available():
        return torch.__version__, "this torch build has no torch.distributed"
    if device == "cpu":
        if not dist.is_gloo_available():
            return torch.__version__, "this torch build has no gloo backend"
        return torch.__version__, None
    # --device cuda: untested by this project's CI (no GPU on its hosts); see the module docstring.
    if not torch.cuda.is_available():
        return torch.__version__, "CUDA is not available to this torch"
    if not dist.is_nccl_available():
        return torch.__version__, "this torch build has no NCCL backend"
    count = torch.cuda.device_count()
    if nproc is not None and count < nproc:
        return torch.__version__, f"--nproc {nproc} needs {nproc} GPUs, {count} visible"
    return torch.__version__, None


def _gpus_short(device, nproc):
    """Why a --device cuda world of ``nproc`` ranks cannot run here (NCCL: one GPU per rank), or None."""
    if device != "cuda":
        return None
    import torch

    count = torch.cuda.device_count()
    return f"needs {nproc} GPUs (NCCL, one per rank), {count} visible" if count < nproc else None


def _set_aside_user_flags():
    names = sorted(k for k in os.environ if k == _flags.GLOBAL_VAR or k.startswith(_flags.PER_FIX_PREFIX))
    found = {k: os.environ.pop(k) for k in names}
    return found


def _prepare(scenarios):
    """Run each distinct prepare hook once, here in the parent. -> {hook: skip reason or error}."""
    from mcore_ckpt_fixes.testing import resolve

    problems = {}
    for hook in dict.fromkeys(s.prepare for s in scenarios if s.prepare):
        try:
            resolve(hook)()  # Megatron's import-time warnings go to the log (see _captured)
        except ModuleNotFoundError as exc:
            problems[hook] = ("skip", f"missing dependency: No module named {exc.name!r}")
        except Exception as exc:
            problems[hook] = ("error", f"prepare {hook} raised {type(exc).__name__}: {exc}")
    return problems


# -- main ------------------------------------------------------------------------------------------


def run(device: str = "cpu", nproc=None, as_json: bool = False) -> int:
    from mcore_ckpt_fixes.testing import for_fix

    info = detect()
    if info.source == "absent":
        print("mcore-ckpt-fixes selftest: Megatron-Core is not importable in this environment", file=sys.stderr)
        return 2
    set_aside = _set_aside_user_flags()
    if set_aside:
        _progress("selftest: ignoring " + ", ".join(f"{k}={v}" for k, v in set_aside.items())
                  + ": each fix runs at its default (auto) and off", "\n")
    torch_version, stack_skip = _stack(device, nproc)
    if torch_version is None:
        print(f"mcore-ckpt-fixes selftest: {stack_skip}", file=sys.stderr)
        return 2

    fixes = ENGINE.discover()
    registered = [s for f in fixes.values() if f.implemented for s in for_fix(f.id)]
    began = time.monotonic()
    rows = []
    fd, log_path = tempfile.mkstemp(prefix="mcore-ckpt-fixes-selftest-", suffix=".log")
    os.close(fd)
    with _captured(log_path):
        # Defaults, now that the user's flags are set aside (probes of modules already imported
        # run here: their warnings go to the log too).
        mcore_ckpt_fixes.revert()
        mcore_ckpt_fixes.apply()
        _progress(f"selftest: importing Megatron-Core {info.version} and the fixes' targets ...", "\n")
        problems = _prepare(registered)
        from .status import import_targets

        import_targets()
        from mcore_ckpt_fixes.testing.launcher import run_world

        report = {r["id"]: r for r in mcore_ckpt_fixes.report()}
        runnable = []
        for fix in fixes.values():
            row = report[fix.id]
            entry = {
                "id": fix.id,
                "summary": fix.summary,
                "implemented": fix.implemented,
                "state": row["state"],
                "reason": row["reason"],
                "affected": fix.affected,
                "in_affected_range": info.version in fix.specifiers if info.version else None,
                "needed": _NEEDED_BY_STATE.get(row["state"]) if fix.implemented else None,
                "megatron_core": row["megatron_core"],
                "megatron_source": row["megatron_source"],
                "torch": torch_version,
                "device": device,
                "nproc": nproc,
                "scenarios": [],
                "seconds": 0.0,
            }
            rows.append(entry)
            if fix.implemented:
                runnable.extend((entry, s) for s in for_fix(fix.id))
        for i, (entry, scenario) in enumerate(runnable, 1):
            _progress(f"selftest [{i}/{len(runnable)}] {scenario.id}: ")
            skip = stack_skip
            absent = None if skip else scenario.absent()
            if skip:  # the stack itself cannot run any scenario (no CUDA, no gloo ...): say that
                pass
            elif entry["state"] == "not-applicable":  # nothing to build: the patched feature is absent
                skip = f"{NOT_APPLICABLE}{entry['reason']}"
            elif absent:
                skip = f"{NOT_APPLICABLE}{absent}"
            elif device not in scenario.devices:
                skip = f"not written for --device {device}"
            elif nproc is not None and nproc != scenario.nproc:
                skip = f"written for exactly {scenario.nproc} ranks; --nproc {nproc} asked"
            elif _gpus_short(device, scenario.nproc):
                skip = _gpus_short(device, scenario.nproc)
            elif scenario.prepare in problems:
                kind, why = problems[scenario.prepare]
                skip = why if kind == "skip" else None
            base = {
                "name": scenario.name,
                "func": scenario.func,
                "nproc": scenario.nproc,
                "doc": scenario.doc,
                "expected_with_fix_off": _expected_off(scenario, entry["needed"], info.version),
            }
            if skip:
                result = {"skipped": skip, "reproduced": None, "exact": None, "seconds": 0.0}
                _progress(f"skipped: {skip}", "\n")
            elif scenario.prepare in problems:  # prepare raised something other than a missing module
                why = problems[scenario.prepare][1]
                result = {"skipped": None, "reproduced": None, "exact": False, "seconds": 0.0, "error": why}
                _progress(f"NOT RUN: {why}", "\n")
            else:
                result = _run_scenario(scenario, entry["needed"], device, scenario.nproc, run_world, info.version)
            entry["scenarios"].append(dict(base, **result))
            entry["seconds"] = round(entry["seconds"] + result["seconds"], 1)

    for entry in rows:
        entry["verdict"] = _verdict(entry)
    code = 0 if all(_passes(e) for e in rows) else 1
    total = time.monotonic() - began
    if code == 0:
        os.unlink(log_path)
    else:
        _progress(f"selftest: what the ranks and Megatron printed is in {log_path}", "\n")
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, info, torch_version, device, nproc, code, total)
    return code


def _verdict(entry) -> str:
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


def _passes(entry) -> bool:
    # Unimplemented fixes are not checked (listed as such); a fix this release does not need does
    # not decide the exit status. Everything else must have run every scenario exactly.
    if entry["verdict"] in ("unimplemented", "not-needed", "not-applicable"):
        return True
    return entry["verdict"] == "pass"


# -- text output -----------------------------------------------------------------------------------


def _yes_no(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def _deltas(values) -> str:
    return ", ".join("crash" if d is None else f"{d:g}" for d in values)


_VERDICT_TEXT = {
    "pass": "PASS: round trip exact with the fix on",
    "fail": "FAIL: a round trip is not exact with the fix on",
    "skipped": "NOT VERIFIED: scenarios skipped on this stack",
    "unverified": "NOT VERIFIED: no round-trip scenario registered for this fix",
    "not-needed": "not needed by this release",
    "not-applicable": "not applicable: the feature it fixes is absent from this release",
}


_OBSERVED_MAX = 300


def _shorten(text: str) -> str:
    """One table cell: a bug seen on several ranks can list dozens of keys; --json keeps it whole."""
    if len(text) <= _OBSERVED_MAX:
        return text
    return text[: _OBSERVED_MAX - 1].rstrip() + "… (whole text: --json)"


def _verdict_text(e) -> str:
    """The verdict, with what it does not decide but a reader must not miss."""
    text = _VERDICT_TEXT[e["verdict"]]
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


def _print_table(rows, info, torch_version, device, nproc, code, total) -> None:
    how = "gloo, forked ranks" if device == "cpu" else "nccl, spawned ranks, one GPU each"
    print(f"mcore-ckpt-fixes {mcore_ckpt_fixes.__version__} selftest: {info.describe()}; "
          f"torch {torch_version}; --device {device} ({how}), "
          + (f"--nproc {nproc}" if nproc is not None else "each scenario at its own world size"))
    pending = [e for e in rows if not e["implemented"]]
    for e in rows:
        if not e["implemented"]:
            continue
        print()
        print(f"{e['id']}: {e['summary']}")
        needed = {True: "yes", False: "no", None: "unknown"}[e["needed"]]
        print(f"  needed by this release: {needed} ({e['state']}; affected {e['affected']})")
        if e["scenarios"]:
            header = ("scenario", "bug with fix off", "exact with fix on", "max |delta| per rank", "time", "observed with the fix off")
            table = []
            for s in e["scenarios"]:
                if s["skipped"] or s.get("error"):
                    what = f"skipped: {s['skipped']}" if s["skipped"] else f"not run: {s['error']}"
                    table.append((s["name"], "-", "-", "-", "-", what))
                    continue
                observed = _shorten(s["fix_off"]["observed"])
                if not s["exact"]:  # the failure itself is never shortened
                    observed += f"  | with the fix on: {s['fix_on']['observed']}"
                table.append((
                    s["name"], _yes_no(s["reproduced"]), _yes_no(s["exact"]),
                    _deltas(s["fix_on"]["max_delta_per_rank"]), f"{s['seconds']:.1f} s", observed,
                ))
            widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header) - 1)]
            for r in [header, *table]:
                print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        print(f"  verdict: {_verdict_text(e)} ({e['seconds']:.1f} s)")
    if pending:
        print()
        print("registered, not implemented yet (nothing patched, not checked):")
        width = max(len(e["id"]) for e in pending)
        for e in pending:
            rng = _yes_no(e["in_affected_range"])
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
        print(f"selftest: PASS in {total:.0f} s: every implemented fix this release needs is exact with the "
              f"fix on ({checked})")
    else:
        failing = [e["id"] for e in rows if e["verdict"] == "fail"]
        unverified = [e["id"] for e in rows if not _passes(e) and e["verdict"] != "fail"]
        why = ([f"not exact with the fix on: {', '.join(failing)}"] if failing else []) + (
            [f"not verified (skipped, or no round trip): {', '.join(unverified)}"] if unverified else []
        )
        print(f"selftest: FAIL in {total:.0f} s: {'; '.join(why)}")
    if unfixed:
        print(f"not checked, not fixed by this package yet, and in this release's affected range: {', '.join(unfixed)}")
