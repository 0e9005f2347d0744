"""mimo-optimizer across releases: the saved-by x loaded-by matrix, each checkpoint moved between envs.

World 2, non-colocated (rank 0 language, rank 1 vision), inner DistributedOptimizer ``dp_reshardable``
(the type that round-trips on CPU, see mcore_ckpt_fixes/scenarios/mimo_optimizer.py). Every saver
and loader is a real environment (``PYTHONPATH=$ENVS/mcore-<rel>:<repo> $ENVS/py3.12/bin/python``)
started as a subprocess running tests/fixes/mimo_matrix_driver.py: one subprocess per env does all
its saves (fix off, fix on), then one per env does all its loads of every checkpoint that exists.
Runs once per tools/test.sh matrix: in the pass of the newest release in tools/releases.txt. 0.16.1
(py3.11, no megatron.core.models.mimo) is not in it.

Result (rows: saved by; columns: loaded by; "off" = MCORE_CKPT_FIXES=off; exact = every optimizer
state tensor delta 0.0, every param-group field and the sharding type equal, on both ranks):

    saved by \\ loaded by | 0.17.1 off | 0.17.1 on | 0.18.2 off | 0.18.2 on | 0.19.2 off | 0.19.2 on
    0.17.1 off           | save fails: COLLISION (the whole row: nothing is written)
    0.17.1 on            | COLLISION  | exact     | COLLISION  | exact     | exact      | exact
    0.18.2 off           | save fails: COLLISION (the whole row: nothing is written)
    0.18.2 on            | COLLISION  | exact     | COLLISION  | exact     | exact      | exact
    0.19.2 off           | NO_COMMON  | NO_COMMON | NO_COMMON  | NO_COMMON | exact      | exact
    0.19.2 on            | NO_COMMON  | NO_COMMON | NO_COMMON  | NO_COMMON | exact      | exact

COLLISION: ``CheckpointingException: Invalid sharding pattern validation. Errors: Duplicate
ShardedObject keys: ['optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1'] ...`` (defect (d):
unpatched 0.17/0.18 name both modules' DistributedOptimizer objects alike, at save and at load;
Megatron's validation raises it on rank 0, the scenario shares it with rank 1).
NO_COMMON: ``CheckpointingException: Common file <ckpt>/common.pt does not exist``: 0.19's
dist_checkpointing keeps the common state inside the torch_dist files (no common.pt), which 0.17/0.18
cannot read, MIMO or not; not something a MIMO fix can change.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, megatron_version

from mcore_ckpt_fixes.scenarios import for_fix

RELEASES_TXT = os.path.join(ROOT, "tools", "releases.txt")
DRIVER = os.path.join(ROOT, "tests", "fixes", "mimo_matrix_driver.py")
MATRIX_RELEASES = ("0.17.1", "0.18.2", "0.19.2")  # the lines with megatron.core.models.mimo
CELLS = [(rel, patched) for rel in MATRIX_RELEASES for patched in (False, True)]
TARGET = "megatron.core.models.mimo.optimizer"

# Exactly the world-2 fix-off error of tests/fixes/test_mimo_optimizer.py (registered scenario).
COLLISION = for_fix("mimo-optimizer")[0].bug.error
NO_COMMON = "CheckpointingException: Common file {ckpt}/common.pt does not exist"


def _releases():
    with open(RELEASES_TXT) as f:
        rows = [ln.split() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return {r[0]: r[1] for r in rows}, rows[-1][0]


PYTHONS, NEWEST = _releases()


def _label(cell):
    rel, patched = cell
    return f"{rel}-{'on' if patched else 'off'}"


def _envs_dir():
    # Where tools/test.sh and tools/envs.sh put them.
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("MCORE_CKPT_FIXES_ENVS") or os.path.join(cache, "mcore-ckpt-fixes", "envs")


def _interpreter(rel):
    envs = _envs_dir()
    py = os.path.join(envs, f"py{PYTHONS[rel]}", "bin", "python")
    lib = os.path.join(envs, f"mcore-{rel}")
    missing = [p for p in (py, lib) if not os.path.exists(p)]
    if missing:
        pytest.fail(
            f"the mimo-optimizer matrix needs the Megatron-Core {rel} environment; missing: {', '.join(missing)} "
            f"(build it with tools/envs.sh {rel}; tools/test.sh builds every release first)"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_CKPT_FIX")}
    env.update(PYTHONPATH=os.pathsep.join([lib, ROOT]), PYTHONDONTWRITEBYTECODE="1")
    return py, env


def _run_driver(rel, jobs, workdir, name):
    py, env = _interpreter(rel)
    jobs_path, out_path = os.path.join(workdir, f"{name}.jobs.json"), os.path.join(workdir, f"{name}.out.json")
    with open(jobs_path, "w") as f:
        json.dump(jobs, f)
    proc = subprocess.run([py, DRIVER, jobs_path, out_path], env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{name} ({rel}) exit {proc.returncode}\nstderr (tail):\n{proc.stderr[-4000:]}"
    with open(out_path) as f:
        out = json.load(f)
    assert len(out) == len(jobs) and all(o["version"] == rel for o in out), (rel, [o["version"] for o in out])
    return out


def _saved_ok(ranks):
    return all(r["ok"] and r["error"] is None for r in ranks)


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    if str(megatron_version()) != NEWEST:
        pytest.skip(f"the saved-by x loaded-by matrix runs once per tools/test.sh run, in the {NEWEST} pass")
    for rel in MATRIX_RELEASES:  # fail before any work when an environment is missing
        _interpreter(rel)
    work = str(tmp_path_factory.mktemp("mimo-matrix"))
    ckpt = {cell: os.path.join(work, "ckpt-" + _label(cell)) for cell in CELLS}
    saves = {}
    for rel in MATRIX_RELEASES:
        jobs = [{"mode": "save", "ckpt_dir": ckpt[(rel, p)], "patched": p} for p in (False, True)]
        for job, out in zip(jobs, _run_driver(rel, jobs, work, f"save-{rel}")):
            saves[(rel, job["patched"])] = out["ranks"]
    loads = {}
    written = [cell for cell in CELLS if _saved_ok(saves[cell])]
    for rel in MATRIX_RELEASES:
        jobs = [{"mode": "load", "ckpt_dir": ckpt[s], "patched": p} for s in written for p in (False, True)]
        outs = _run_driver(rel, jobs, work, f"load-{rel}")
        for (saver, patched), out in zip([(s, p) for s in written for p in (False, True)], outs):
            loads[(saver, (rel, patched))] = out["ranks"]
    return {"ckpt": ckpt, "saves": saves, "loads": loads}


def _fix_state(cell):
    rel, patched = cell
    if not patched:
        return "disabled"
    return "applied" if rel in ("0.17.1", "0.18.2") else "not-needed"


def _assert_raised(ranks, phase, error):
    for rank, r in enumerate(ranks):
        assert r["ok"], (rank, r.get("crash"))
        assert (r["phase"], r["error"]) == (phase, error), (rank, r["phase"], r["error"], r.get("traceback"))


def _assert_exact(ranks, loader):
    assert [r.get("module") for r in ranks] == ["language", "vision"], ranks
    for rank, r in enumerate(ranks):
        assert r["ok"], (rank, r.get("crash"))
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        assert r["bad_groups"] == [] and r["sharding_type"] == "dp_reshardable", (rank, r["bad_groups"], r["sharding_type"])
        assert r["warnings"] == [], (rank, r["warnings"])  # the current layout: nothing to warn about
        assert r["fix_state"] == {TARGET: _fix_state(loader)}, (rank, r["fix_state"])


@pytest.mark.parametrize("saver", CELLS, ids=_label)
def test_save(saver, matrix):
    ranks = matrix["saves"][saver]
    rel, patched = saver
    if rel in ("0.17.1", "0.18.2") and not patched:
        # Defect (d): the two modules' DistributedOptimizer objects collide; nothing is written.
        _assert_raised(ranks, "save", COLLISION)
        assert not os.path.exists(os.path.join(matrix["ckpt"][saver], "metadata.json"))
    else:
        for rank, r in enumerate(ranks):
            assert r["ok"] and r["error"] is None, (rank, r.get("error") or r.get("crash"))
            assert r["fix_state"] == {TARGET: _fix_state(saver)}, (rank, r["fix_state"])
        files = set(os.listdir(matrix["ckpt"][saver]))
        # 0.17/0.18 write the common state to common.pt; 0.19 inside the torch_dist files.
        assert ("common.pt" in files) == (rel != "0.19.2"), files


@pytest.mark.parametrize("loader", CELLS, ids=_label)
@pytest.mark.parametrize("saver", CELLS, ids=_label)
def test_load(saver, loader, matrix):
    s_rel, s_patched = saver
    l_rel, l_patched = loader
    if s_rel in ("0.17.1", "0.18.2") and not s_patched:
        # The whole row: the save failed (test_save asserts its error), there is nothing to load.
        _assert_raised(matrix["saves"][saver], "save", COLLISION)
        assert (saver, loader) not in matrix["loads"]
        return
    ranks = matrix["loads"][(saver, loader)]
    if s_rel == "0.19.2" and l_rel != "0.19.2":
        # 0.19 writes no common.pt (its common state lives in the torch_dist files); 0.17/0.18's
        # dist_checkpointing.load reads common.pt first. A container-format change, not MIMO's.
        _assert_raised(ranks, "load", NO_COMMON.format(ckpt=matrix["ckpt"][saver]))
    elif l_rel in ("0.17.1", "0.18.2") and not l_patched:
        # Unpatched 0.17/0.18 ask for the same colliding keys on load as on save (defect (d)).
        _assert_raised(ranks, "load", COLLISION)
        assert ranks[0]["rank_errors"] == [COLLISION, None], ranks[0]["rank_errors"]  # raised on rank 0
    else:
        _assert_exact(ranks, loader)
