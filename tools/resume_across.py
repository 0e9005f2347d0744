"""The resume check across releases: save on one Megatron-Core release line, resume on another.

    python tools/resume_across.py [--main TREE [--main-commit HASH]] [--keep DIR]

Per pair and configuration below, ``python -m mcore_ckpt_fixes.cli.resume_across save`` runs in the
saving release's environment (A and B) and ``... resume`` in the resuming one (C, compared with A
bit for bit; where it differs, also with the resuming release's own A, to tell a lossy checkpoint
from changed training math). ``--main TREE``: also the rows resumed on a Megatron-LM source tree
(``git archive`` of main), with the 0.19.2 environment's packages as its dependencies. Prints one
table; exit 1 when a row recorded as exact below (``EXACT``) is no longer exact (or fails).
Environments: tools/envs.sh (cached), as tools/test.sh lays them out; Python 3.12. It takes about
14 minutes on a busy 2-core host (docs/resume.md, "Across releases"): run by hand, not by tools/test.sh.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVS = os.environ.get("MCORE_CKPT_FIXES_ENVS") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcore-ckpt-fixes", "envs"
)
CONFIGS = ("moe-ep2", "dense-tp2")
# (saved on, fixes there, resumed on, fixes there); "main" needs --main.
PAIRS = (
    ("0.17.1", "on", "0.18.2", "on"),
    ("0.18.2", "on", "0.19.2", "on"),
    ("0.17.1", "on", "0.19.2", "on"),
)
MAIN_PAIRS = (
    ("0.19.2", "on", "main", "on"),
    ("0.19.2", "off", "main", "on"),  # the unfixed 2-D RNG layout, read by main with the fixes
    ("0.19.2", "on", "main", "off"),  # main as upstream ships it, reading a fixed checkpoint
)
# Rows measured exact (docs/resume.md, "Across releases"): one that stops being exact fails the run.
EXACT = (
    {(s, sf, r, rf, c) for s, sf, r, rf in PAIRS for c in CONFIGS}
    | {("0.19.2", "on", "main", "on", c) for c in CONFIGS}
    | {("0.19.2", "off", "main", "on", "dense-tp2")}
)
# Raised inside every torch_dist load_checkpoint by torch itself, on a same-release resume too:
# counted in the table, not spelled out.
TORCH_NOISE = (
    "UserWarning: The argument order of load has been changed",
    "UserWarning: torch.distributed is disabled, unavailable or uninitialized",
    "FutureWarning: Please use DTensor instead and we are deprecating ShardedTensor",
)


def _env(release, main_tree):
    """(python, environment) of a release line, or of the main tree on the 0.19.2 line's packages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    path = [os.path.join(ENVS, f"mcore-{release}"), ROOT]
    if release == "main":
        # The tree first, so that its megatron (a namespace package, as the wheel's) wins.
        path = [main_tree, os.path.join(ENVS, "mcore-0.19.2"), ROOT]
    env.update(PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")
    return os.path.join(ENVS, "py3.12", "bin", "python"), env


def _run(release, main_tree, args, log):
    python, env = _env(release, main_tree)
    with open(log, "w") as f:
        return subprocess.run(
            [python, "-m", "mcore_ckpt_fixes.cli.resume_across", *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=900,
            check=False,
        ).returncode


def _saved(work, release, fixes, config, main_tree):
    """The directory of that save, made once (several pairs resume from one save)."""
    where = os.path.join(work, f"save-{release}-{fixes}-{config}")
    if not os.path.exists(os.path.join(where, "saved.json")):
        _run(release, main_tree, ["save", config, where, "--fixes", fixes], where + ".log")
    return where


def _warnings(out):
    shown = [w["text"] for w in out.get("load_warnings", []) if not w["text"].startswith(TORCH_NOISE)]
    noise = sum(1 for w in out.get("load_warnings", []) if w["text"].startswith(TORCH_NOISE))
    return shown + ([f"({noise} of torch's own, as on any load)"] if noise else [])


def _row(work, pair, config, main_tree):
    """One table row: resume from the saving release's directory, read the verdict it wrote."""
    saved_on, saved_fixes, resumed_on, resumed_fixes = pair
    where = _saved(work, saved_on, saved_fixes, config, main_tree)
    verdict = os.path.join(work, f"{saved_on}-{saved_fixes}-{resumed_on}-{resumed_fixes}-{config}.json")
    code = _run(
        resumed_on,
        main_tree,
        ["resume", config, where, "--fixes", resumed_fixes, "--out", verdict],
        verdict[:-5] + ".log",
    )
    try:
        with open(verdict) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {"verdict": "error", "line": f"resume exited {code} without a verdict (see {verdict[:-5]}.log)"}
    return {
        "pair": pair,
        "config": config,
        "verdict": out["verdict"],
        "line": out["line"],
        "warnings": _warnings(out),
        "cause": out.get("here", {}).get("cause"),
    }


def _print(rows, seconds, main_commit):
    print(
        f"resume across releases: save (A, B) on one line, resume (C) on another; C vs A bit for bit "
        f"({seconds:.0f} s){'; main at ' + main_commit if main_commit else ''}"
    )
    for r in rows:
        s, sf, y, yf = r["pair"]
        print(f"  {s} (fixes {sf}) -> {y} (fixes {yf})  {r['config']}: {r['line']}")
        for w in r["warnings"]:
            print(f"      load warning: {w}")


def _main_commit(tree):
    """The commit of a main tree that is a git checkout; a ``git archive`` tree does not say
    (``--main-commit`` then names it for the table)."""
    proc = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown commit"


def main(argv):
    main_tree = argv[argv.index("--main") + 1] if "--main" in argv else None
    keep = argv[argv.index("--keep") + 1] if "--keep" in argv else None
    work = keep or tempfile.mkdtemp(prefix="mcore-ckpt-fixes-across-")
    os.makedirs(work, exist_ok=True)
    pairs = PAIRS + (MAIN_PAIRS if main_tree else ())
    start = time.monotonic()
    try:
        rows = [_row(work, pair, config, main_tree) for pair in pairs for config in CONFIGS]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    commit = argv[argv.index("--main-commit") + 1] if "--main-commit" in argv else None
    _print(rows, time.monotonic() - start, (commit or _main_commit(main_tree)) if main_tree else "")
    lost = [r for r in rows if (*r["pair"], r["config"]) in EXACT and r["verdict"] != "exact"]
    for r in lost:
        print(
            f"resume_across: {' -> '.join(r['pair'][::2])} {r['config']} was exact, now: {r['line']}", file=sys.stderr
        )
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
