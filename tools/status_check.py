"""CI's quick check of every published release: ``status --json`` gives each fix the state measured
for that release (tools/expected-status.json, from tools/sweep.sh) and never ``failed``.

    python tools/status_check.py [--write] [RELEASE ...]
Environments: tools/envs.sh (cached); status needs no particular torch, so the standard venvs serve.
``--write`` records what is measured now as the expected states (after reviewing a sweep).
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = os.path.join(ROOT, "tools", "expected-status.json")
ENVS = os.environ.get("MCORE_CKPT_FIXES_ENVS") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcore-ckpt-fixes", "envs"
)


def releases():
    with open(os.path.join(ROOT, "tools", "sweep-releases.txt")) as f:
        rows = [ln.split() for ln in f if ln.strip() and not ln.startswith("#")]
    return {r[0]: r[1] for r in rows}


def status(release, python):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ENVS, f"mcore-{release}"), ROOT]), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [os.path.join(ENVS, f"py{python}", "bin", "python"), "-m", "mcore_ckpt_fixes", "status", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"status_check: {release}: status exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return {row["id"]: row["state"] for row in json.loads(proc.stdout)}


def main(argv):
    write = "--write" in argv
    wanted = [a for a in argv if not a.startswith("--")]
    known = releases()
    names = wanted or list(known)
    subprocess.run(["bash", os.path.join(ROOT, "tools", "envs.sh"), *names], check=True, stdout=sys.stderr)
    expected = {}
    if os.path.exists(EXPECTED):
        with open(EXPECTED) as f:
            expected = json.load(f)
    problems, measured = [], {}
    start = time.monotonic()
    # Two releases at a time: each is one interpreter importing Megatron-Core (mostly one core's work).
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda rel: status(rel, known[rel]), names))
    for rel, got in zip(names, results):
        measured[rel] = got
        failed = [f for f, s in got.items() if s == "failed"]
        if failed:
            problems.append(f"{rel}: failed: {', '.join(failed)}")
        if not write and got != expected.get(rel):
            diff = {f: (expected.get(rel, {}).get(f), s) for f, s in got.items() if expected.get(rel, {}).get(f) != s}
            problems.append(f"{rel}: states differ from tools/expected-status.json (expected, got): {diff}")
        print(f"status_check: {rel}: " + ", ".join(f"{f}={s}" for f, s in got.items()), file=sys.stderr)
    if write:
        expected.update(measured)
        with open(EXPECTED, "w") as f:
            json.dump(expected, f, indent=1, sort_keys=True)
            f.write("\n")
    print(
        f"status_check: {len(names)} releases in {time.monotonic() - start:.0f} s: "
        + ("OK" if not problems else f"{len(problems)} problem(s)"),
        file=sys.stderr,
    )
    for p in problems:
        print("status_check: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
