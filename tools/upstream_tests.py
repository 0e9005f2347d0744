#!/usr/bin/env python3
"""Upstream Megatron-LM's own unit tests of the code the fixes patch, with the fixes off and on.

    python3 tools/upstream_tests.py RELEASE --repo DIR [--only PATTERN] [--json OUT] [--adam torch|fused]
                                    [--nproc N] [--test-timeout S] [--keep]

Takes the tests of the release's tag (``core_v<RELEASE>``, else the highest ``core_v<X.Y>.*`` below
it: 0.19.2 runs core_v0.19.0's) from a Megatron-LM git repository, bare or not (``--repo``, else
``$MEGATRON_LM_REPO``: one of them is required; no network), runs those of SUITE under torchrun with
N ranks (default 2) on the CPU with gloo in the release's cached environment (tools/envs.sh), once
with ``MCORE_CKPT_FIXES=off`` and once with the fixes on (tools/upstream_tests/upstream_ranks.py
imports the package in every rank before the tests), and prints each mode's counts and every test
whose outcome (per rank: passed, failed, error, skipped, timeout, hang, crashed) differs.

Every test has a deadline (``--test-timeout``, pytest-timeout; a test stuck in C code past it and the
collective timeout is a hang: the launch's process group is killed). A launch that ends before its
last test (a crash, a hang) is started again after the test it stopped in, which counts as its own
outcome. Exit 0: no outcome differs; 1: some differ; 2: bad usage (no repository given among them),
or nothing ran: the tag has no test of SUITE, ``--only`` matches none, or no test has an outcome in
either mode; a run of nothing proves nothing, so it is never reported as "no outcome differs".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_DIR = os.path.join(ROOT, "tools", "upstream_tests")
ENVS = os.environ.get("MCORE_CKPT_FIXES_ENVS") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcore-ckpt-fixes", "envs"
)

# Upstream's tests of the modules the fixes patch (dist_checkpointing, the optimizers, the
# distributed optimizer, the scheduler, megatron.training.checkpointing, MIMO's optimizer, the FSDP
# DTensor checkpoint), where the tag has them.
SUITE = (
    "tests/unit_tests/dist_checkpointing",
    "tests/unit_tests/test_checkpointing.py",
    "tests/unit_tests/test_optimizer.py",
    "tests/unit_tests/optimizer",
    "tests/unit_tests/test_optimizer_cpu_offloading.py",
    "tests/unit_tests/test_optimizer_param_scheduler.py",
    "tests/unit_tests/models/test_mimo_checkpoint.py",
    "tests/unit_tests/models/mimo/test_mimo_checkpoint.py",
    "tests/unit_tests/transformer/test_fsdp_dtensor_checkpoint.py",
)
# Left out, and why (docs/validation.md).
EXCLUDED = {
    "tests/unit_tests/dist_checkpointing/test_layer_wise_optimizer.py": "442 tests, about 3.5 min a mode, none "
    "can pass on a CPU host with 2 ranks: Muon needs emerging-optimizers (no PyPI wheel), the rest need 4-8 "
    "ranks or Transformer Engine's layer specs",
}
# What the tests import beside tests/ (0.19's MIMO tests import examples/mimo).
EXTRA = ("tests/__init__.py", "tests/unit_tests", "examples/__init__.py", "examples/mimo")
# Where the release's wheel ships no megatron.training (0.16), upstream's test helpers import it
# anyway: Megatron-LM's own, from the same tag, with the packages it imports.
TRAINING = ("megatron/training", "megatron/legacy", "megatron/rl", "megatron/post_training")
# ... and the third-party packages only its import needs, inert where the environment lacks them.
TRAINING_STANDINS = "six,regex,pydantic"
ORDER = ("crashed", "hang", "timeout", "error", "failed", "xpassed", "passed", "xfailed", "skipped", "absent")


def fail(message: str):
    print(f"upstream_tests: {message}", file=sys.stderr)
    raise SystemExit(2)


def python_for(release: str) -> str:
    for name in ("releases.txt", "sweep-releases.txt"):
        with open(os.path.join(ROOT, "tools", name)) as f:
            for line in f:
                cols = line.split()
                if cols and not line.startswith("#") and cols[0] == release:
                    return os.path.join(ENVS, f"py{cols[1]}", "bin", "python")
    fail(f"unknown release {release} (tools/releases.txt, tools/sweep-releases.txt)")


def pick_tag(repo: str, release: str) -> str:
    """``core_v<release>``, else the highest ``core_v<major>.<minor>.<patch>`` at or below it."""
    tags = subprocess.run(["git", "-C", repo, "tag", "-l", "core_v*"], capture_output=True, text=True).stdout.split()
    want = tuple(int(x) for x in release.split(".")[:3])
    found = []
    for tag in tags:
        m = re.fullmatch(r"core_v(\d+)\.(\d+)\.(\d+)", tag)
        if m and tuple(map(int, m.groups()))[:2] == want[:2] and tuple(map(int, m.groups())) <= want:
            found.append((tuple(map(int, m.groups())), tag))
    if not found:
        fail(f"no tag core_v{want[0]}.{want[1]}.x at or below {release} in {repo}")
    return max(found)[1]


def extract(repo: str, tag: str, dest: str, training: bool) -> None:
    wanted = EXTRA + (TRAINING if training else ())
    listed = subprocess.run(
        ["git", "-C", repo, "ls-tree", "--name-only", tag, *wanted], capture_output=True, text=True
    ).stdout.split()
    archive = subprocess.Popen(["git", "-C", repo, "archive", tag, *listed], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        fail(f"git archive {tag} failed in {repo}")
    # Upstream's conftest imports its CI's test-data downloader (not part of tests/unit_tests) and
    # goes on when it raises ImportError: here nothing is downloaded.
    stub = os.path.join(dest, "tests", "test_utils", "python_scripts")
    os.makedirs(stub, exist_ok=True)
    for name in ("tests/test_utils/__init__.py", "tests/test_utils/python_scripts/__init__.py"):
        open(os.path.join(dest, name), "a").close()
    with open(os.path.join(stub, "download_unit_tests_dataset.py"), "w") as f:
        f.write("def download_and_extract_asset(*args, **kwargs):\n    raise ImportError('no test data offline')\n")


class Mode:
    """One pass over the suite: ``off`` (MCORE_CKPT_FIXES=off) or ``on`` (every fix's default)."""

    def __init__(self, name: str, args, python: str, src: str, paths: list, work: str, training: bool):
        self.name, self.args, self.python, self.src, self.paths = name, args, python, src, paths
        self.training = training  # megatron.training taken from the tag
        self.out = os.path.join(work, name)
        os.makedirs(self.out)
        self.results: dict = {}  # nodeid -> {rank: (outcome, message)}
        self.applied: set = set()  # fixes a rank applied, reported at the end of a launch
        self.seconds = 0.0

    def env(self, launch: int) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
        env.update(
            PYTHONPATH=os.pathsep.join([self.src, PLUGIN_DIR, os.path.join(ENVS, f"mcore-{self.args.release}"), ROOT]),
            PYTHONDONTWRITEBYTECODE="1",
            CUDA_VISIBLE_DEVICES="",
            UPSTREAM_TESTS_OUT=self.out,
            UPSTREAM_TESTS_LAUNCH=str(launch),
            UPSTREAM_TESTS_ONLY=self.args.only or "",
            UPSTREAM_TESTS_ADAM=self.args.adam,
            UPSTREAM_TESTS_PG_TIMEOUT=str(self.args.collective_timeout),
            UPSTREAM_TESTS_STANDINS=TRAINING_STANDINS if self.training else "",
        )
        if self.name == "off":
            env["MCORE_CKPT_FIXES"] = "off"
        return env

    def command(self, launch: int) -> list:
        logs = os.path.join(self.out, f"logs{launch}")
        return [
            self.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(self.args.nproc), "--log-dir", logs, "--redirects", "3",
            "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_ranks", "-q", "--tb=short",
            "--continue-on-collection-errors", "--timeout", str(self.args.test_timeout),
            "-o", "addopts=", "--rootdir", self.src,
            *[arg for path in EXCLUDED for arg in ("--ignore", path)], *self.paths,
        ]  # fmt: skip

    def run(self) -> None:
        start = time.monotonic()
        for launch in range(1, 1000):
            killed = self.launch(launch)
            if not self.settle(launch, killed):
                break
        self.seconds = time.monotonic() - start

    def launch(self, launch: int) -> bool:
        """One torchrun; True when it was killed because no rank wrote for too long (a hang)."""
        stall = self.args.test_timeout + self.args.collective_timeout + 120
        with open(os.path.join(self.out, f"launch{launch}.log"), "w") as log:
            proc = subprocess.Popen(
                self.command(launch), cwd=self.src, env=self.env(launch), start_new_session=True,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                last = (None, time.monotonic())
                while proc.poll() is None:
                    time.sleep(1)
                    size = sum(os.path.getsize(p) for p in self.logs() if os.path.exists(p))
                    if size != last[0]:
                        last = (size, time.monotonic())
                    elif time.monotonic() - last[1] > stall:
                        return True
                return False
            finally:
                kill_group(proc)  # also what the ranks left running, and on Ctrl-C

    def logs(self) -> list:
        return [os.path.join(self.out, f"rank{r}.jsonl") for r in range(self.args.nproc)]

    def settle(self, launch: int, killed: bool) -> bool:
        """Record what the launch's ranks wrote; True when tests remain (the launch stopped in one,
        which gets its outcome here: hang or crashed on the ranks that did not end it)."""
        collected_file = os.path.join(self.out, f"collected.{launch}.rank0.txt")
        before = len(self.results)
        for rank, path in enumerate(self.logs()):
            for record in read_jsonl(path):
                if record["event"] == "fixes":
                    self.applied.update(record["applied"])
                if record["event"] == "end":
                    self.results.setdefault(record["nodeid"], {}).setdefault(
                        rank, (record["outcome"], record["message"])
                    )
        if not os.path.exists(collected_file):
            fail(f"{self.name}: launch {launch} collected nothing; see {self.out}/launch{launch}.log (--keep)")
        with open(collected_file) as f:
            collected = [line.rstrip("\n") for line in f]
        pending = [n for n in collected if len(self.results.get(n, {})) < self.args.nproc]
        if not pending:
            return False
        stopped = pending[0]
        if len(self.results) == before and stopped not in self.results and not self.started(stopped):
            fail(
                f"{self.name}: launch {launch} ended before its first test; see {self.out}/launch{launch}.log (--keep)"
            )
        outcome = "hang" if killed else "crashed"
        why = "no rank wrote for too long: the launch was killed" if killed else "the launch ended during the test"
        for rank in range(self.args.nproc):
            self.results.setdefault(stopped, {}).setdefault(rank, (outcome, why))
        with open(os.path.join(self.out, "done.txt"), "w") as f:
            f.writelines(n + "\n" for n in self.results)
        print(f"  {self.name}: launch {launch} stopped in {stopped} ({outcome}); going on after it", flush=True)
        return True

    def started(self, nodeid: str) -> bool:
        return any(r["event"] == "start" and r["nodeid"] == nodeid for p in self.logs() for r in read_jsonl(p))

    def outcomes(self) -> dict:
        """nodeid -> one outcome per rank, e.g. ('failed', 'failed')."""
        return {
            n: tuple(by_rank.get(r, ("absent", ""))[0] for r in range(self.args.nproc))
            for n, by_rank in self.results.items()
        }

    def counts(self) -> dict:
        counts: dict = {}
        for per_rank in self.outcomes().values():
            worst = min(per_rank, key=ORDER.index)  # a test failed on one rank failed
            counts[worst] = counts.get(worst, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: ORDER.index(kv[0])))

    def line(self, nodeid: str) -> str:
        by_rank = self.results.get(nodeid, {})
        parts = [
            f"{o}{f' ({m})' if m else ''}" for o, m in (by_rank.get(r, ("absent", "")) for r in range(self.args.nproc))
        ]
        return parts[0] if len(set(parts)) == 1 else " | ".join(f"rank {r}: {p}" for r, p in enumerate(parts))


def read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]  # a half-written last line: skipped


def kill_group(proc) -> None:
    """torchrun, its ranks and whatever they started (the checkpoint writer's processes)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def nothing_ran(off, on, only) -> str | None:
    """Why neither mode has a test outcome, or None when one has: equal counts of nothing would
    read as "no outcome differs" while nothing was compared."""
    if off.results or on.results:
        return None
    if only:
        return f"no test matches --only {only!r} (0 tests with the fixes off and on)"
    return "no test was collected (0 tests with the fixes off and on)"


def compare(off: Mode, on: Mode) -> tuple:
    """(tests whose outcome differs, tests with the same outcome and another first error line)."""
    a, b = off.outcomes(), on.outcomes()
    absent = tuple(["absent"] * off.args.nproc)
    differ = sorted(n for n in set(a) | set(b) if a.get(n, absent) != b.get(n, absent))
    other_line = sorted(n for n in set(a) & set(b) if a[n] == b[n] and n not in differ and off.line(n) != on.line(n))
    return differ, other_line


def report(args, tag: str, paths: list, off: Mode, on: Mode, differ: list, other_line: list) -> None:
    print(
        f"Megatron-Core {args.release}: upstream's tests of {tag}, {args.nproc} ranks, gloo on the CPU, {args.adam} Adam"
    )
    print(f"  ran: {' '.join(paths)}{f' (--only {args.only})' if args.only else ''}")
    for path, why in EXCLUDED.items():
        print(f"  left out: {path}: {why}")
    for mode in (off, on):
        counts = ", ".join(f"{k} {v}" for k, v in mode.counts().items())
        print(f"  fixes {mode.name:3}: {len(mode.results)} tests: {counts} ({mode.seconds:.0f} s)")
        print(f"           fixes applied in the ranks: {', '.join(sorted(mode.applied)) or 'none'}")
    print(f"outcome differs: {len(differ)}")
    for nodeid in differ:
        print(f"  {nodeid}\n    off: {off.line(nodeid)}\n    on:  {on.line(nodeid)}")
    if other_line:
        print(f"same outcome, another first line: {len(other_line)}")
        for nodeid in other_line:
            print(f"  {nodeid}\n    off: {off.line(nodeid)}\n    on:  {on.line(nodeid)}")


def write_json(path: str, args, tag: str, paths: list, off: Mode, on: Mode, differ: list, other_line: list) -> None:
    modes = {
        m.name: {
            "seconds": round(m.seconds, 1),
            "counts": m.counts(),
            "applied": sorted(m.applied),
            "tests": {
                n: [list(m.results[n].get(r, ("absent", ""))) for r in range(args.nproc)] for n in sorted(m.results)
            },
        }
        for m in (off, on)
    }
    data = dict(release=args.release, tag=tag, nproc=args.nproc, adam=args.adam, only=args.only, ran=paths)
    data.update(excluded=EXCLUDED, modes=modes, differ=differ, same_outcome_other_line=other_line)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("release", help="a Megatron-Core release with a cached environment, e.g. 0.19.2")
    p.add_argument(
        "--only", metavar="PATTERN", help="only tests whose node id contains PATTERN (or matches it as a glob)"
    )
    p.add_argument("--json", metavar="OUT", help="write every test's outcome per rank and mode to OUT")
    p.add_argument(
        "--repo", help="a Megatron-LM git repository, bare or not (required unless $MEGATRON_LM_REPO names one)"
    )
    p.add_argument(
        "--adam",
        choices=("torch", "fused"),
        default="torch",
        help="torch's Adam, as Megatron picks on a CPU host (default), or the FusedAdam path (Apex's, a CPU stand-in)",
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks (default %(default)s)")
    p.add_argument("--test-timeout", type=int, default=180, help="seconds per test (default %(default)s)")
    p.add_argument("--collective-timeout", type=int, default=60, help="gloo's timeout in seconds (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (extracted tests, logs) and say where")
    args = p.parse_args(argv)
    args.repo = args.repo or os.environ.get("MEGATRON_LM_REPO")
    if not args.repo:
        fail("no Megatron-LM repository given: pass --repo DIR or set MEGATRON_LM_REPO (a git clone, bare or not)")
    if not re.fullmatch(r"\d+\.\d+\.\d+", args.release) or args.nproc < 1:
        p.error(f"bad release or --nproc: {args.release}, {args.nproc}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    python = python_for(args.release)
    if not (os.path.exists(python) and os.path.isdir(os.path.join(ENVS, f"mcore-{args.release}"))):
        fail(f"no environment for {args.release} under {ENVS}: run tools/envs.sh {args.release}")
    if (
        not os.path.isdir(args.repo)
        or subprocess.run(["git", "-C", args.repo, "rev-parse"], capture_output=True).returncode
    ):
        fail(f"no Megatron-LM git repository at {args.repo} (--repo or MEGATRON_LM_REPO)")
    tag = pick_tag(args.repo, args.release)
    work = tempfile.mkdtemp(prefix=f"upstream-tests-{args.release}-")
    try:
        src = os.path.join(work, "src")
        os.makedirs(src)
        training = not os.path.isdir(os.path.join(ENVS, f"mcore-{args.release}", "megatron", "training"))
        extract(args.repo, tag, src, training)
        paths = [p for p in SUITE if os.path.exists(os.path.join(src, p))]
        if not paths:
            # pytest given no path would collect the whole extracted tree instead.
            fail(f"nothing ran: {tag} has none of the suite's tests ({', '.join(SUITE)})")
        print(f"upstream_tests: {args.release} with {tag}'s tests; work folder {work}", flush=True)
        if training:
            print(f"upstream_tests: the {args.release} wheel has no megatron.training: {tag}'s is used", flush=True)
        off, on = (Mode(name, args, python, src, paths, work, training) for name in ("off", "on"))
        for mode in (off, on):
            mode.run()
        why = nothing_ran(off, on, args.only)
        if why:
            fail(f"nothing ran: {why}")
        differ, other_line = compare(off, on)
        report(args, tag, paths, off, on, differ, other_line)
        if args.json:
            write_json(args.json, args, tag, paths, off, on, differ, other_line)
        return 1 if differ else 0
    finally:
        if args.keep:
            print(f"upstream_tests: kept {work}")
        else:
            subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    sys.exit(main())
