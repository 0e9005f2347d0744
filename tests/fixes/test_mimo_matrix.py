"""mimo-optimizer across releases: the saved-by x loaded-by matrix, each checkpoint moved between envs.

World 2, non-colocated (rank 0 language, rank 1 vision). Every saver and loader is a real
environment (``PYTHONPATH=$ENVS/mcore-<rel>:<repo> $ENVS/py3.12/bin/python``) started as a subprocess
running tests/fixes/mimo_matrix_driver.py: one subprocess per env does all its saves, then one per
env does all its loads of every checkpoint that exists. Runs once per tools/test.sh matrix: in the
pass of the newest release in tools/releases.txt. 0.16.1 (py3.11, no megatron.core.models.mimo) is
not in it. "off" = MCORE_CKPT_FIXES=off; exact = every optimizer state tensor delta 0.0, every
param-group field and the sharding type equal, on both ranks.

Three configurations: unpatched 0.17/0.18 can write a checkpoint in ``mixed`` and ``adam`` only,
and ``adam`` shows defect (e) (each module's common state) on every release:

``dist``: both modules' inner optimizers are DistributedOptimizers (``dp_reshardable``, the type
that round-trips on CPU, see mcore_ckpt_fixes/fixes/mimo_optimizer/checks/core.py). All six savers:

    saved by \\ loaded by | 0.17.1 off | 0.17.1 on | 0.18.2 off | 0.18.2 on | 0.19.2 off | 0.19.2 on
    0.17.1 off           | save fails: COLLISION (the whole row: nothing is written)
    0.17.1 on            | COLLISION  | exact     | COLLISION  | exact     | exact      | exact
    0.18.2 off           | save fails: COLLISION (the whole row: nothing is written)
    0.18.2 on            | COLLISION  | exact     | COLLISION  | exact     | exact      | exact
    0.19.2 off           | NO_COMMON  | NO_COMMON | NO_COMMON  | NO_COMMON | exact      | exact
    0.19.2 on            | NO_COMMON  | NO_COMMON | NO_COMMON  | NO_COMMON | exact      | exact

``mixed``: the language model (rank 0) has a non-distributed optimizer (its keys are its parameters'
names), the vision encoder (rank 1) a DistributedOptimizer: nothing collides, so unpatched 0.17/0.18
save, in their old layout (no ``mimo.<module>.`` prefix; 0.17 also leaves vision's sharding type in
the common state that only rank 0 writes, i.e. nowhere). The rows only these savers can give:

    saved by \\ loaded by | 0.17.1 off   | 0.17.1 on | 0.18.2 off  | 0.18.2 on | 0.19.2 off | 0.19.2 on
    0.17.1 off           | NO_TYPE (b)  | exact+W   | NO_TYPE_KEY | exact+W   | NO_PREFIX  | exact+W
    0.18.2 off           | NO_TYPE (b)  | exact+W   | exact       | exact+W   | NO_PREFIX  | exact+W

``adam``: both modules on Megatron's non-distributed optimizer over torch's AdamW (bf16; the
configuration of upstream's own test_mimo_checkpoint.py), whose step shared by all parameters is
plain common state (``optimizer.state.common_step``), written by global rank 0 (language) only. The
0.19.2 rows' loads by 0.17/0.18 are not run (NO_COMMON, as in ``dist``):

    saved by \\ loaded by | 0.17.1 off | 0.17.1 on | 0.18.2 off | 0.18.2 on | 0.19.2 off | 0.19.2 on
    0.17.1 off           | NO_STEP    | STEP+W    | NO_STEP    | STEP+W    | NO_PREFIX  | STEP+W
    0.17.1 on            | NO_UNPREF  | exact     | NO_UNPREF  | exact     | NO_STEP    | exact
    0.18.2 off           | NO_STEP    | STEP+W    | NO_STEP    | STEP+W    | NO_PREFIX  | STEP+W
    0.18.2 on            | NO_UNPREF  | exact     | NO_UNPREF  | exact     | NO_STEP    | exact
    0.19.2 off           | (not run)  | (not run) | (not run)  | (not run) | NO_STEP    | STEP+W
    0.19.2 on            | (not run)  | (not run) | (not run)  | (not run) | NO_STEP    | exact

NO_STEP: defect (e), ``KeyError: 'step'`` in torch's ``Adam.__setstate__`` on the vision rank (its
Adam state comes back without a step). NO_UNPREF: unpatched 0.17/0.18 ask for the unprefixed keys
(``KeyError: "optimizer.state.exp_avg.language_model... from model not in state dict``). STEP+W:
the checkpoint has no per-module common state, so the vision step is not in it: every tensor and
param-group field exact except the vision step, which is the language model's (the fix's stated
source: MimoOptimizer steps every module together; the saved steps differ per module here on
purpose), with a MegatronPatchWarning naming ``vision.optimizer.state.common_step`` and where it
came from (plus the old-layout warning for 0.17/0.18's unprefixed keys).

COLLISION: ``CheckpointingException: Invalid sharding pattern validation. Errors: Duplicate
ShardedObject keys: ['optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1'] ...`` (defect (d):
unpatched 0.17/0.18 name both modules' DistributedOptimizer objects alike, at save and at load;
Megatron's validation raises it on rank 0, the scenario shares it with rank 1).
NO_COMMON: ``CheckpointingException: Common file <ckpt>/common.pt does not exist``: 0.19's
dist_checkpointing keeps the common state inside the torch_dist files (no common.pt), which 0.17/0.18
cannot read, MIMO or not; not something a MIMO fix can change.
exact+W: exact, and each rank gets one MegatronPatchWarning naming the old layout (and, for 0.17's
checkpoint, the vision sharding type it took from the load's own request).
NO_TYPE (b): unpatched 0.17 loses the vision module's ``param_state_sharding_type`` (defect (b),
end to end): ``AssertionError: dict_keys(['param_state', 'optimizer'])`` in DistributedOptimizer's
load on rank 1. NO_TYPE_KEY: unpatched 0.18 asks for the sharding-type object 0.17 never wrote
(``Missing key in checkpoint state_dict: optimizer.mimo.vision.param_state_sharding_type/...``).
NO_PREFIX: unpatched 0.19 asks only for ``mimo.<module>.`` keys (``KeyError: "mimo.language...
from model not in state dict``): the load side this fix adds on 0.19.
"""

import json
import os
import subprocess

import pytest

from conftest import ROOT, envs_dir, megatron_version

from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.scenarios import MIMO_WORLD2_BUG

RELEASES_TXT = os.path.join(ROOT, "tools", "releases.txt")
DRIVER = os.path.join(ROOT, "tests", "fixes", "mimo_matrix_driver.py")
MATRIX_RELEASES = ("0.17.1", "0.18.2", "0.19.2")  # the lines with megatron.core.models.mimo
CELLS = [(rel, patched) for rel in MATRIX_RELEASES for patched in (False, True)]
TARGET = "megatron.core.models.mimo.optimizer"

# Exactly the world-2 fix-off error of tests/fixes/test_mimo_optimizer.py (registered scenario).
COLLISION = MIMO_WORLD2_BUG.error
NO_COMMON = "CheckpointingException: Common file {ckpt}/common.pt does not exist"
NO_TYPE = "AssertionError: dict_keys(['param_state', 'optimizer'])"
NO_TYPE_KEY = "Missing key in checkpoint state_dict: optimizer.mimo.vision.param_state_sharding_type/shard_0_1."
NO_PREFIX = (
    'KeyError: "mimo.language.optimizer.state.exp_avg.language_model.module.fc1.weight from model not in state dict'
)
NO_UNPREFIXED = 'KeyError: "optimizer.state.exp_avg.language_model.module.fc1.weight from model not in state dict'
NO_STEP = "KeyError: 'step'"

# Inner optimizer type per configuration, and the savers whose rows each configuration gives.
CONFIGS = {
    "dist": "dp_reshardable",
    "mixed": {"language": "non_distributed", "vision": "dp_reshardable"},
    "adam": "non_distributed",
}
SAVERS = {"dist": CELLS, "mixed": [("0.17.1", False), ("0.18.2", False)], "adam": CELLS}
SAVE_CASES = [(config, saver) for config in CONFIGS for saver in SAVERS[config]]


def _runs(case, loader):
    """Is this load run? 0.19's checkpoints cannot be read by 0.17/0.18 at all (NO_COMMON, MIMO or
    not): the ``dist`` rows show it; the ``adam`` rows leave those eight worlds out."""
    config, (s_rel, _) = case
    return not (config == "adam" and s_rel == "0.19.2" and loader[0] != "0.19.2")


def _releases():
    with open(RELEASES_TXT) as f:
        rows = [ln.split() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    return {r[0]: r[1] for r in rows}, rows[-1][0]


PYTHONS, NEWEST = _releases()


def _label(cell):
    rel, patched = cell
    return f"{rel}-{'on' if patched else 'off'}"


def _interpreter(rel):
    envs = envs_dir()
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


def _case_label(case):
    config, saver = case
    return f"{config}-{_label(saver)}"


@pytest.fixture(scope="session")
def matrix(tmp_path_factory):
    if str(megatron_version()) != NEWEST:
        pytest.skip(f"the saved-by x loaded-by matrix runs once per tools/test.sh run, in the {NEWEST} pass")
    for rel in MATRIX_RELEASES:  # fail before any work when an environment is missing
        _interpreter(rel)
    work = str(tmp_path_factory.mktemp("mimo-matrix"))
    ckpt = {case: os.path.join(work, "ckpt-" + _case_label(case)) for case in SAVE_CASES}
    saves = {}
    for rel in MATRIX_RELEASES:
        cases = [case for case in SAVE_CASES if case[1][0] == rel]
        jobs = [
            {"mode": "save", "ckpt_dir": ckpt[case], "patched": case[1][1], "sharding_type": CONFIGS[case[0]]}
            for case in cases
        ]
        for case, out in zip(cases, _run_driver(rel, jobs, work, f"save-{rel}")):
            saves[case] = out["ranks"]
    loads = {}
    written = [case for case in SAVE_CASES if _saved_ok(saves[case])]
    for rel in MATRIX_RELEASES:
        pairs = [(case, (rel, patched)) for case in written for patched in (False, True) if _runs(case, (rel, patched))]
        jobs = [
            {"mode": "load", "ckpt_dir": ckpt[case], "patched": loader[1], "sharding_type": CONFIGS[case[0]]}
            for case, loader in pairs
        ]
        for pair, out in zip(pairs, _run_driver(rel, jobs, work, f"load-{rel}")):
            loads[pair] = out["ranks"]
    return {"ckpt": ckpt, "saves": saves, "loads": loads}


def _fix_state(cell):
    rel, patched = cell
    return "applied" if patched else "disabled"  # 0.19.2 too: the load side (see the fix's status)


def _assert_raised(ranks, phase, error):
    for rank, r in enumerate(ranks):
        assert r["ok"], (rank, r.get("crash"))
        assert (r["phase"], r["error"]) == (phase, error), (rank, r["phase"], r["error"], r.get("traceback"))


def _assert_raised_containing(ranks, phase, text, failing_ranks):
    """Every rank reports the world's first error (it contains ``text``); ``failing_ranks`` raised it."""
    for rank, r in enumerate(ranks):
        assert r["ok"], (rank, r.get("crash"))
        assert r["phase"] == phase and text in (r["error"] or ""), (rank, r["phase"], r["error"])
    raised = [i for i, e in enumerate(ranks[0]["rank_errors"]) if e]
    assert raised == failing_ranks, ranks[0]["rank_errors"]


def _old_layout_warning(ckpt, module, assumed):
    text = (
        f"mcore_ckpt_fixes: mimo-optimizer: {ckpt} holds the MIMO optimizer state of module(s) {module} in "
        f"the layout of an unfixed Megatron-Core 0.17/0.18 (keys without the 'mimo.<module>.' prefix); "
        f"read from those keys"
    )
    if assumed:
        text += (
            "; not stored there (0.17 keeps it in the common state, which only global rank 0 writes), so "
            f"taken from this load's request, whose keys the checkpoint has: {assumed}"
        )
    return text + "; the next save writes the current layout"


def _assert_exact(ranks, loader, config, warnings=(None, None)):
    assert [r.get("module") for r in ranks] == ["language", "vision"], ranks
    types = CONFIGS[config]
    for rank, r in enumerate(ranks):
        assert r["ok"], (rank, r.get("crash"))
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
        own = types[r["module"]] if isinstance(types, dict) else types
        expected_type = None if own == "non_distributed" else own
        assert r["bad_groups"] == [] and r["sharding_type"] == expected_type, (
            rank,
            r["bad_groups"],
            r["sharding_type"],
        )
        assert r["warnings"] == ([] if warnings[rank] is None else [warnings[rank]]), (rank, r["warnings"])
        assert r["fix_state"] == {TARGET: _fix_state(loader)}, (rank, r["fix_state"])


@pytest.mark.parametrize("case", SAVE_CASES, ids=_case_label)
def test_save(case, matrix):
    config, saver = case
    ranks = matrix["saves"][case]
    rel, patched = saver
    if config == "dist" and rel in ("0.17.1", "0.18.2") and not patched:
        # Defect (d): the two modules' DistributedOptimizer objects collide; nothing is written.
        _assert_raised(ranks, "save", COLLISION)
        assert not os.path.exists(os.path.join(matrix["ckpt"][case], "metadata.json"))
        return
    for rank, r in enumerate(ranks):
        assert r["ok"] and r["error"] is None, (rank, r.get("error") or r.get("crash"))
        assert r["fix_state"] == {TARGET: _fix_state(saver)}, (rank, r["fix_state"])
    files = set(os.listdir(matrix["ckpt"][case]))
    # 0.17/0.18 write the common state to common.pt; 0.19 inside the torch_dist files.
    assert ("common.pt" in files) == (rel != "0.19.2"), files


@pytest.mark.parametrize("loader", CELLS, ids=_label)
@pytest.mark.parametrize("saver", CELLS, ids=_label)
def test_load_dist(saver, loader, matrix):
    s_rel, s_patched = saver
    l_rel, l_patched = loader
    case = ("dist", saver)
    if s_rel in ("0.17.1", "0.18.2") and not s_patched:
        # The whole row: the save failed (test_save asserts its error), there is nothing to load.
        _assert_raised(matrix["saves"][case], "save", COLLISION)
        assert (case, loader) not in matrix["loads"]
        return
    ranks = matrix["loads"][(case, loader)]
    if s_rel == "0.19.2" and l_rel != "0.19.2":
        # 0.19 writes no common.pt (its common state lives in the torch_dist files); 0.17/0.18's
        # dist_checkpointing.load reads common.pt first. A container-format change, not MIMO's.
        _assert_raised(ranks, "load", NO_COMMON.format(ckpt=matrix["ckpt"][case]))
    elif l_rel in ("0.17.1", "0.18.2") and not l_patched:
        # Unpatched 0.17/0.18 ask for the same colliding keys on load as on save (defect (d)).
        _assert_raised(ranks, "load", COLLISION)
        assert ranks[0]["rank_errors"] == [COLLISION, None], ranks[0]["rank_errors"]  # raised on rank 0
    else:
        _assert_exact(ranks, loader, "dist")  # the current layout: no warning


@pytest.mark.parametrize("loader", CELLS, ids=_label)
@pytest.mark.parametrize("saver", SAVERS["mixed"], ids=_label)
def test_load_old_layout(saver, loader, matrix):
    """Checkpoints unpatched 0.17/0.18 wrote: every patched loader reads them exactly, with the warning."""
    s_rel, _ = saver
    l_rel, l_patched = loader
    case = ("mixed", saver)
    ckpt = matrix["ckpt"][case]
    ranks = matrix["loads"][(case, loader)]
    if l_patched:
        assumed = "vision.param_state_sharding_type = 'dp_reshardable'" if s_rel == "0.17.1" else None
        warnings = (_old_layout_warning(ckpt, "language", None), _old_layout_warning(ckpt, "vision", assumed))
        _assert_exact(ranks, loader, "mixed", warnings)
    elif l_rel == "0.17.1":
        # Defect (b) end to end: the vision rank's sharding type is not in what it loads.
        _assert_raised_containing(ranks, "load_state_dict", NO_TYPE, [1])
        assert ranks[0]["error"] == NO_TYPE
    elif l_rel == "0.18.2" and s_rel == "0.17.1":
        _assert_raised_containing(ranks, "load", NO_TYPE_KEY, [1])  # vision asks for it
    elif l_rel == "0.18.2":
        _assert_exact(ranks, loader, "mixed")  # its own layout
    else:  # unpatched 0.19.2: only the prefixed keys are asked for
        _assert_raised_containing(ranks, "load", NO_PREFIX, [0, 1])


def _common_state_warning(ckpt, recovered):
    return (
        f"mcore_ckpt_fixes: mimo-optimizer: {ckpt} holds no per-module common state for the MIMO optimizer "
        f"module(s) vision (saved without it: by Megatron-Core 0.17-0.19.2, patched by an earlier "
        f"mcore_ckpt_fixes or not): a module's plain optimizer state is only in the common state, which "
        f"global rank 0 writes, so theirs is not in the checkpoint; in its place: {recovered}; the next "
        f"save writes the current layout"
    )


@pytest.mark.parametrize("loader", CELLS, ids=_label)
@pytest.mark.parametrize("saver", SAVERS["adam"], ids=_label)
def test_load_adam(saver, loader, matrix):
    """torch AdamW behind the non-distributed optimizer on both modules (defect (e)): the step."""
    from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.core import SAVE_SEED, saved_step

    s_rel, s_patched = saver
    l_rel, l_patched = loader
    case = ("adam", saver)
    ckpt = matrix["ckpt"][case]
    if not _runs(case, loader):
        assert (case, loader) not in matrix["loads"]  # NO_COMMON, as the dist rows show
        return
    ranks = matrix["loads"][(case, loader)]
    unprefixed = s_rel in ("0.17.1", "0.18.2") and not s_patched  # the 0.17/0.18 key layout
    lang, vision = saved_step(SAVE_SEED, "language"), saved_step(SAVE_SEED, "vision")
    if not l_patched:
        if unprefixed == (l_rel == "0.19.2"):
            # The loader asks for the other key layout (every rank's DCP read fails).
            _assert_raised_containing(ranks, "load", NO_PREFIX if unprefixed else NO_UNPREFIXED, [0, 1])
        else:
            # Defect (e): the vision rank's Adam state comes back without its step.
            _assert_raised_containing(ranks, "load_state_dict", NO_STEP, [1])
            assert ranks[0]["error"] == NO_STEP
    elif s_patched:
        _assert_exact(ranks, loader, "adam")  # each module's own common state: no warning
        assert [r["steps"] for r in ranks] == [[lang] * len(ranks[0]["steps"]), [vision] * len(ranks[1]["steps"])]
        assert ranks[0]["steps"], ranks
    else:
        # Written without per-module common state: the vision step is not in the checkpoint. The
        # fix loads everything else exactly and, with the warning, the step of the language model
        # (on global rank 0, so in the common state): the saved values differ here on purpose.
        n = len(ranks[1]["steps"])
        diff = [f"group {i} step: saved {vision}, loaded {lang}" for i in range(n)]
        error = f"AssertionError: loaded state differs from the saved one: {diff}"
        recovered = (
            f"vision.optimizer.state.common_step = {lang} (taken from module language: MimoOptimizer steps "
            f"every module together)"
        )
        old = [_old_layout_warning(ckpt, m, None) for m in ("language", "vision")] if unprefixed else [None, None]
        expected_warnings = [
            [w for w in (old[0],) if w],
            sorted(w for w in (old[1], _common_state_warning(ckpt, recovered)) if w),
        ]
        assert n > 0 and [r.get("module") for r in ranks] == ["language", "vision"], ranks
        for rank, r in enumerate(ranks):
            assert r["ok"] and (r["phase"], r["error"]) == ("compare", error), (rank, r["phase"], r["error"])
            assert r["n_tensors"] > 0 and set(r["max_delta"].values()) == {0.0}, (rank, r["max_delta"])
            assert r["bad_groups"] == ([] if rank == 0 else diff) and r["steps"] == [lang] * n, (rank, r)
            assert r["warnings"] == expected_warnings[rank], (rank, r["warnings"])
            assert r["fix_state"] == {TARGET: "applied"}, (rank, r["fix_state"])
        assert ranks[0]["rank_errors"] == [None, error]
