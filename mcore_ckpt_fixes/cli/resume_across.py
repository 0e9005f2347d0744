"""The resume check across releases: save on one Megatron-Core, resume on another.

    python -m mcore_ckpt_fixes.cli.resume_across save CONFIG DIR [--fixes on|off]
    python -m mcore_ckpt_fixes.cli.resume_across resume CONFIG DIR [--fixes on|off] [--out FILE] [--json]

``save`` runs A (uninterrupted) and B (train, ``save_checkpoint``) of the configuration
(:mod:`..resume.configs`) with this interpreter's Megatron-Core and writes under DIR: ``uninterrupted.pkl``
(A's results per rank), ``ckpt/`` (B's checkpoint) and ``saved.json`` (which Megatron-Core wrote it,
and with which fixes). ``resume``, typically in an environment with another Megatron-Core, runs C
from ``DIR/ckpt`` and compares it per rank with that A, bit for bit (:func:`..resume.compare.rank_verdict`);
it also lists every warning ``load_checkpoint`` raised. Where C differs from A, it runs A here too:
C equal to this release's own A means the checkpoint carried every value and the two releases train
differently; C different from it means state was lost or changed on the way.

Exit status: 0 exact, 1 inexact, 2 an error (a world failed, or DIR holds no save).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile

from ..resume import check
from ..resume.compare import differing, rank_verdict, same
from ..resume.configs import by_name


def stack() -> dict:
    """The Megatron-Core this interpreter imports and the states of the fixes there (default flags)."""
    import torch

    import mcore_ckpt_fixes
    from mcore_ckpt_fixes.engine.version import detect

    info = detect()
    return {
        "megatron_core": str(info.version),
        "source": info.source,
        "path": info.path,
        "torch": torch.__version__,
        "fix_states": {r["id"]: r["state"] for r in mcore_ckpt_fixes.report()},
    }


def _world(cfg, phase, ckpt_dir, fixes):
    """(values per rank, error line, traceback): one world of forked ranks, every fix at ``fixes``."""
    return check.run_phase(cfg, phase, ckpt_dir, check.MODES[fixes], "cpu", 240.0)


def save(cfg, out_dir, fixes) -> dict:
    """A and B here; what the resume side needs is written under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    # A saves nothing, but its arguments name a directory: not the one B's checkpoint goes to.
    uninterrupted, error, detail = _world(cfg, "uninterrupted", tempfile.gettempdir(), fixes)
    if error is None:
        _, error, detail = _world(cfg, "save", os.path.join(out_dir, "ckpt"), fixes)
    saved = {"config": cfg.name, "fixes": fixes, "error": error, "detail": detail, **stack()}
    if error is None:
        with open(os.path.join(out_dir, "uninterrupted.pkl"), "wb") as f:
            pickle.dump(uninterrupted, f)
    with open(os.path.join(out_dir, "saved.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return saved


def _warnings(resumed) -> list:
    """Each distinct warning raised inside load_checkpoint, with the ranks that raised it."""
    seen = {}
    for value in resumed:
        for text in value.get("load_warnings", []):
            seen.setdefault(text, []).append(value["coords"]["rank"])
    return [{"ranks": sorted(set(ranks)), "times": len(ranks), "text": text} for text, ranks in seen.items()]


def _ranks(expected, resumed) -> list:
    ranks = [rank_verdict(a, c) for a, c in zip(expected, resumed)]
    for r in ranks:
        r.pop("differ_all")  # the count and the first names say enough in a report
        r.pop("compared_all")
    return ranks


def _same_run(a, b) -> bool:
    """Two uninterrupted runs agree bit for bit: every loss and every final value."""
    return same(a["losses"], b["losses"]) and not differing(a["state"], b["state"])


def resume(cfg, out_dir, fixes) -> dict:
    """C here from ``out_dir``, compared with the saving release's A (and, if it differs, this one's)."""
    with open(os.path.join(out_dir, "saved.json")) as f:
        saved = json.load(f)
    out = {
        "config": cfg.name,
        "saved": {k: v for k, v in saved.items() if k not in ("error", "detail")},
        "resumed": {**stack(), "fixes": fixes},
    }
    out.update(_resumed(cfg, out_dir, fixes, saved["error"]))
    out["line"] = describe(out)
    return out


def _resumed(cfg, out_dir, fixes, save_error) -> dict:
    """The verdict part: C against the saving release's A, the load warnings, and C against this A."""
    if save_error:
        return {"verdict": "error", "error": f"the save side failed: {save_error}"}
    with open(os.path.join(out_dir, "uninterrupted.pkl"), "rb") as f:
        uninterrupted = pickle.load(f)
    resumed, error, detail = _world(cfg, "resume", os.path.join(out_dir, "ckpt"), fixes)
    if error:
        return {"verdict": "error", "error": error, "detail": detail}
    ranks = _ranks(uninterrupted, resumed)
    out = {
        "verdict": "exact" if all(r["exact"] for r in ranks) else "inexact",
        "ranks": ranks,
        "load_warnings": _warnings(resumed),
    }
    if out["verdict"] == "inexact":
        out["here"] = _against_here(cfg, uninterrupted, resumed, fixes)
    return out


def _against_here(cfg, uninterrupted, resumed, fixes) -> dict:
    """C against this release's own uninterrupted run: tells a lossy checkpoint from changed math."""
    here, error, detail = _world(cfg, "uninterrupted", tempfile.gettempdir(), fixes)
    if error:
        return {"verdict": "error", "error": error, "detail": detail}
    ranks = _ranks(here, resumed)
    exact = all(r["exact"] for r in ranks)
    return {
        "verdict": "exact" if exact else "inexact",
        "ranks": ranks,
        "uninterrupted_same": all(_same_run(a, b) for a, b in zip(uninterrupted, here)),
        "cause": "math" if exact else "checkpoint",
    }


def describe(out) -> str:
    """One line for a verdict."""
    from .selftest_resume import describe as one_mode

    line = out["error"] if out["verdict"] == "error" else one_mode(out)
    here = out.get("here")
    if here is None:
        return line
    if here["verdict"] == "error":
        return line + f"; this release's own A failed: {here['error']}"
    if here["uninterrupted_same"]:
        # Then C against this release's A is the comparison above again: say so, not it twice.
        return line + "; A is bit for bit the same on both releases: state was lost or changed in the checkpoint"
    if here["cause"] == "math":
        return line + (
            "; exact against this release's own A: the checkpoint carried every value, the two "
            "releases train differently"
        )
    return line + f"; against this release's own A: {one_mode(here)} (state lost or changed in the checkpoint)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_ckpt_fixes.cli.resume_across", description=__doc__.split("\n")[0]
    )
    parser.add_argument("action", choices=("save", "resume"))
    parser.add_argument("config", help="a configuration of mcore_ckpt_fixes.resume.configs, e.g. moe-ep2")
    parser.add_argument("dir", help="where save writes, and resume reads, A's results and B's checkpoint")
    parser.add_argument("--fixes", choices=("on", "off"), default="on", help="every fix at its default, or off")
    parser.add_argument("--out", help="resume: also write the JSON verdict to this file")
    parser.add_argument("--json", action="store_true", help="resume: print the JSON verdict instead of one line")
    args = parser.parse_args(argv)
    cfg = by_name(args.config)
    import mcore_ckpt_fixes

    from .selftest_run import set_aside_user_flags

    # Only --fixes decides: a shell's per-fix flag would otherwise reach the forked ranks (and the
    # fix states recorded beside the verdict are the defaults').
    set_aside_user_flags()
    mcore_ckpt_fixes.revert()
    mcore_ckpt_fixes.apply()
    check.prepare()
    if args.action == "save":
        saved = save(cfg, args.dir, args.fixes)
        print(
            f"{cfg.name}: saved on Megatron-Core {saved['megatron_core']} ({saved['source']}), fixes {args.fixes}: "
            + (saved["error"] or f"A and B done, under {args.dir}")
        )
        return 2 if saved["error"] else 0
    out = resume(cfg, args.dir, args.fixes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
    print(json.dumps(out, indent=2, default=str) if args.json else f"{cfg.name}: {out['line']}")
    for w in [] if args.json else out.get("load_warnings", []):
        print(f"  load warning on ranks {w['ranks']}: {w['text']}")
    return {"exact": 0, "inexact": 1}.get(out["verdict"], 2)


if __name__ == "__main__":
    sys.exit(main())
