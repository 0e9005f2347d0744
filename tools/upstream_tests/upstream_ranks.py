"""pytest plugin of tools/upstream_tests.py (``-p upstream_ranks``): one rank of a torchrun world
that runs Megatron-LM's own unit tests on the CPU with gloo.

Before the tests' conftest imports Megatron: the CPU shims and the ``mamba_ssm`` stand-in of
``mcore_ckpt_fixes.testing`` and those of ``upstream_cpu_host`` (beside this file), then
``import mcore_ckpt_fixes``, as a user's job does first (the fixes on, or nothing with
``MCORE_CKPT_FIXES=off``). Upstream's ``Utils.initialize_distributed``
starts NCCL with one GPU per rank; here it starts gloo, and ``Utils.initialize_model_parallel``
first destroys the previous test's process groups. Every test runs inside ``cuda_to_cpu_mode()``
and ``cpu_streams()``; with ``UPSTREAM_TESTS_ADAM=fused`` Megatron takes its Apex FusedAdam path
(``mcore_ckpt_fixes.testing._fused_adam``), else torch's Adam as it does on a CPU host.

The ranks start each test together (a file barrier): a test that fails on one rank while another
waits in a collective costs that test only. Each rank appends one JSON line when a test starts and
one with its outcome when it ends (``<out>/rank<N>.jsonl``), which the tool reads, also after a
crash or a kill. Tests listed in ``<out>/done.txt`` (ended in an earlier launch) are deselected.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import time
from datetime import timedelta

import pytest
import torch

OUT = os.environ["UPSTREAM_TESTS_OUT"]
LAUNCH = os.environ.get("UPSTREAM_TESTS_LAUNCH", "0")
ONLY = os.environ.get("UPSTREAM_TESTS_ONLY", "")
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
PG_TIMEOUT = float(os.environ.get("UPSTREAM_TESTS_PG_TIMEOUT", "60"))
BARRIER_TIMEOUT = float(os.environ.get("UPSTREAM_TESTS_BARRIER_TIMEOUT", "300"))

import upstream_cpu_host as cpu_host  # noqa: E402  (beside this plugin)

cpu_host.stand_in_modules(os.environ.get("UPSTREAM_TESTS_STANDINS", ""))

from mcore_ckpt_fixes.testing import _cpu_shims as cpu_shims  # noqa: E402
from mcore_ckpt_fixes.testing._standins import install_mamba_ssm_stand_in  # noqa: E402

install_mamba_ssm_stand_in()
cpu_shims.install()
cpu_host.install_cuda_stream()

import mcore_ckpt_fixes  # noqa: E402

cpu_host.te_version_without_te()

_LOG = open(os.path.join(OUT, f"rank{RANK}.jsonl"), "a", buffering=1)
_reports: dict = {}
_barriers = 0
_optimizer_path = None


def _emit(**record) -> None:
    _LOG.write(json.dumps(record) + "\n")


def matches(nodeid: str, pattern: str) -> bool:
    """``--only``: a substring of the node id (brackets and all), or a glob (``*``, ``?``, ``[``)
    matched anywhere in it."""
    if not pattern or pattern in nodeid:
        return True
    return any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(nodeid, f"*{pattern}*")


def _barrier() -> None:
    """Every rank gets here, or BARRIER_TIMEOUT passes (a rank that died: the tool sees it)."""
    global _barriers
    _barriers += 1
    folder = os.path.join(OUT, "sync", LAUNCH)
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"{_barriers}.{RANK}"), "w").close()
    names = [os.path.join(folder, f"{_barriers}.{r}") for r in range(WORLD)]
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while not all(os.path.exists(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.02)


def _initialize_distributed():
    """Upstream's ``Utils.initialize_distributed`` with gloo instead of NCCL, no
    ``torch.cuda.set_device``, and a collective timeout that lets a rank whose peer failed go on."""
    from torch._C._distributed_c10d import PrefixStore
    from torch.distributed import rendezvous

    from tests.unit_tests.test_utilities import Utils

    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)
    if not torch.distributed.is_initialized() and Utils.rank >= 0:
        init = f"tcp://{os.getenv('MASTER_ADDR', 'localhost')}:{os.getenv('MASTER_PORT', '29500')}"
        store, _, _ = next(rendezvous(init, Utils.rank, Utils.world_size, timeout=timedelta(minutes=1)))
        store.set_timeout(timedelta(minutes=1))
        Utils.store = store = PrefixStore("default_pg", store)
        torch.distributed.init_process_group(
            backend="gloo",
            world_size=Utils.world_size,
            rank=Utils.rank,
            store=store,
            timeout=timedelta(seconds=PG_TIMEOUT),
        )
        torch.distributed.barrier()
    Utils.inited = True


def _drop_groups() -> None:
    """Destroy every process group but the default one. Megatron's ``destroy_model_parallel`` only
    forgets its groups; each gloo group keeps three threads until it is destroyed, and a few hundred
    tests leave thousands of them waking up (the CPU then goes to them, not to the tests)."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    if torch.distributed.is_initialized():
        for group in list(c10d._world.pg_map):
            if group is not c10d.GroupMember.WORLD:
                torch.distributed.destroy_process_group(group)
    gc.collect()


def _wrap_utils(Utils) -> None:
    init_model_parallel, set_world_size = Utils.initialize_model_parallel, Utils.set_world_size

    def initialize_model_parallel(*args, **kwargs):
        # Upstream's calls Megatron's destroy_model_parallel first: any group left then is garbage.
        import megatron.core.parallel_state as ps

        ps.destroy_model_parallel()
        _drop_groups()
        return init_model_parallel(*args, **kwargs)

    def set_world_size_(world_size=None, rank=None):
        # Upstream's default is torch.cuda.device_count(), one rank per GPU: here the world's size.
        return set_world_size(WORLD if world_size is None else world_size, rank)

    Utils.initialize_distributed = staticmethod(_initialize_distributed)
    Utils.initialize_model_parallel = staticmethod(initialize_model_parallel)
    Utils.set_world_size = staticmethod(set_world_size_)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """One temporary folder per rank, both in one parent: upstream's ``tmp_path_dist_ckpt``, the
    folder the ranks share, is two levels above ``tmp_path_factory``'s base."""
    os.makedirs(os.path.join(OUT, "tmp", "ranks"), exist_ok=True)
    config.option.basetemp = os.path.join(OUT, "tmp", "ranks", f"rank{RANK}")


def pytest_sessionstart(session):
    from tests.unit_tests.test_utilities import Utils

    _wrap_utils(Utils)
    if os.environ.get("UPSTREAM_TESTS_ADAM") == "fused":
        from mcore_ckpt_fixes.testing._fused_adam import optimizer_path

        global _optimizer_path  # held: a collected context manager would restore torch's Adam
        _optimizer_path = optimizer_path(apex=True)
        _optimizer_path.__enter__()  # for the whole session; the process ends with it


def pytest_sessionfinish(session):
    """Which fixes this rank applied, once the tests imported what they patch (none with the flag off)."""
    applied = sorted(r["id"] for r in mcore_ckpt_fixes.report() if r["state"] == "applied")
    _emit(event="fixes", applied=applied)


def pytest_collectreport(report):
    if report.failed and matches(report.nodeid, ONLY):  # a module that does not import
        _emit(event="end", nodeid=report.nodeid, outcome="error", message=_first_line(report), duration=0.0)


def pytest_collection_modifyitems(session, config, items):
    done = set()
    if os.path.exists(os.path.join(OUT, "done.txt")):
        with open(os.path.join(OUT, "done.txt")) as f:
            done = {line.rstrip("\n") for line in f}
    keep = [item for item in items if item.nodeid not in done and matches(item.nodeid, ONLY)]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
    with open(os.path.join(OUT, f"collected.{LAUNCH}.rank{RANK}.txt"), "w") as f:
        f.writelines(item.nodeid + "\n" for item in keep)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's: the wait is no test's time
def pytest_runtest_protocol(item, nextitem):
    _barrier()
    _reports[item.nodeid] = []
    _emit(event="start", nodeid=item.nodeid)
    start = time.monotonic()
    with cpu_shims.cuda_to_cpu_mode(), cpu_shims.cpu_streams():
        yield
    outcome, message = _outcome(_reports.pop(item.nodeid, []))
    _emit(
        event="end", nodeid=item.nodeid, outcome=outcome, message=message, duration=round(time.monotonic() - start, 2)
    )


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def _outcome(reports) -> tuple:
    """pytest's own verdict: a failed setup or teardown is an error, a failed call a failure;
    pytest-timeout's failure is a timeout."""
    for report in reports:
        if report.failed:
            line = _first_line(report)
            if line.startswith("Failed: Timeout"):
                return "timeout", line
            return ("failed" if report.when == "call" else "error"), line
    for report in reports:
        if report.skipped:
            return ("xfailed" if hasattr(report, "wasxfail") else "skipped"), _first_line(report)
    if any(hasattr(report, "wasxfail") for report in reports):
        return "xpassed", ""
    return "passed", ""


def _first_line(report) -> str:
    """The exception's first line (a skip: its reason), without object addresses or this run's
    folders, so that the two modes' lines compare."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        text = str(longrepr[2])
    else:
        crash = getattr(longrepr, "reprcrash", None)
        lines = [ln for ln in str(longrepr).splitlines() if ln.startswith("E ")] or str(longrepr).splitlines()
        text = crash.message if crash is not None else (lines[-1] if lines else "")
    text = text.strip()
    line = re.sub(r"^E\s+", "", text.splitlines()[0]) if text else ""
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line.replace(OUT, "<out>"))
    return line[:300]
