"""scheduler-checkpoint-wd: both halves on the affected CI lines (0.16.1 through dist_checkpointing;
0.17.1, 0.18.2 and 0.19.2 also through megatron.training), one warm world each.

World 2 (gloo on CPU): the distributed optimizer and Megatron's scheduler saved with a weight decay
rising from 0.01 to 0.02 (megatron.training: --weight-decay 0.01), resumed with a constant 0.05
(--weight-decay 0.05) and --use-checkpoint-opt_param-scheduler; every group's lr and weight decay
against a scheduler with the saved arguments after the same steps, no load. See
mcore_ckpt_fixes/fixes/scheduler_checkpoint_wd/checks/core.py.

In fresh interpreters, on the scheduler itself: each weight-decay argument changed alone; where the
release's load is right (arguments unchanged, no --use-checkpoint, the override, an old checkpoint
without weight-decay fields) the fix writes the same bits; a source carrying upstream's order is
judged not-needed; and the fix composes with scheduler-override-group-lr's layer on the same method.
"""

import json

import pytest
from conftest import run_py
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.scheduler_checkpoint_wd import FIX
from mcore_ckpt_fixes.fixes.scheduler_checkpoint_wd.checks import scenarios as sc

CORE = "mcore_ckpt_fixes.fixes.scheduler_checkpoint_wd.checks.core"
MODULE = "megatron.core.optimizer_param_scheduler"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    # The fix-off half as selftest and the GPU check run it: every fix off.
    return both_halves(FIX, f"{CORE}:round_trip", sc.SCENARIOS[0].off_env(), tmp_path_factory, mcore_version)


def _paths(mcore_version):
    return ("dist", "training") if mcore_version.release >= (0, 17) else ("dist",)


def _with_decay(r, path):
    """The groups the checkpoint's schedule gives a weight decay (wd_mult 1), by index."""
    reference = r["weight_decay"]["checkpoint" if path == "dist" else "training_checkpoint"]
    return [i for i, wd in enumerate(reference) if wd != 0.0]


def test_unpatched_first_step_takes_the_new_arguments_weight_decay(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.NEW_ARGUMENTS_WD.phase, sc.NEW_ARGUMENTS_WD.error), (
            rank,
            r.get("traceback"),
        )
        wd = r["weight_decay"]
        # What the first resumed optimizer step would use: the new arguments' weight decay, group by
        # group, not the checkpoint's (silently: the load completed).
        assert wd["dist"] == wd["arguments"] != wd["checkpoint"], wd
        if "training" in _paths(mcore_version):
            assert wd["training"] == wd["training_arguments"] != wd["training_checkpoint"], wd
        differing = {k for k, d in r["max_delta"].items() if d != 0.0}
        expected = {f"{p}/group{i}/weight_decay" for p in _paths(mcore_version) for i in _with_decay(r, p)}
        # Only those groups' weight decay: lr right, the unchanged arguments right, and from the
        # scheduler's next step on the checkpoint's weight decay (dist-next/).
        assert expected and differing == expected, (differing, expected)
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_first_step_takes_the_checkpoint_weight_decay(worlds, mcore_version):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        paths = {"dist", "dist-same", "dist-next", *_paths(mcore_version)}
        assert {k.split("/")[0] for k in r["max_delta"]} == paths, r["max_delta"]
        wd = r["weight_decay"]
        assert wd["dist"] == wd["checkpoint"] != wd["arguments"], wd
        if "training" in _paths(mcore_version):
            assert wd["training"] == wd["training_checkpoint"] != wd["training_arguments"], wd


# -- the scheduler alone, in fresh interpreters (the fixes at their defaults) -------------------------

SETUP = """
import json, types
import mcore_ckpt_fixes
from mcore_ckpt_fixes.engine.patching import original
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler as S

RELEASE = original(S, "load_state_dict")
OUT = {}  # each part's result, by name, printed at the end
BASE = dict(init_lr=0.0, max_lr=0.01, min_lr=0.001, lr_warmup_steps=1, lr_decay_steps=10, lr_decay_style="cosine",
            start_wd=0.01, end_wd=0.01, wd_incr_steps=10, wd_incr_style="constant")


def groups():
    # As Megatron's optimizer has them: a group with weight decay, one without (wd_mult 0).
    return [{"lr": 0.0, "weight_decay": 0.0, "wd_mult": 1.0}, {"lr": 0.0, "weight_decay": 0.0, "wd_mult": 0.0}]


def bits(opt):
    return [[float(g["lr"]).hex(), float(g["weight_decay"]).hex()] for g in opt.param_groups]


def saved_state(saved, steps=3):
    opt = types.SimpleNamespace(param_groups=groups())
    s = S(opt, **{**BASE, **saved})
    s.step(increment=steps)
    return s.state_dict()


def loaded(load, state, run, **flags):
    '''A new scheduler built with the run's arguments, loaded with ``load``: its groups and state.'''
    opt = types.SimpleNamespace(param_groups=groups())
    s = S(opt, **{**BASE, **run}, **flags)
    load(s, dict(state))
    return bits(opt), sorted((k, repr(v)) for k, v in s.state_dict().items())


def scheduled(args, steps=3):
    '''The groups as a scheduler with ``args`` sets them after ``steps``, no load.'''
    opt = types.SimpleNamespace(param_groups=groups())
    S(opt, **{**BASE, **args}).step(increment=steps)
    return bits(opt)
"""

CHANGES = {
    "weight-decay": ({"start_wd": 0.01, "end_wd": 0.01}, {"start_wd": 0.05, "end_wd": 0.05}),
    "start-end-weight-decay": (
        {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "linear"},
        {"start_wd": 0.03, "end_wd": 0.06, "wd_incr_style": "linear"},
    ),
    "weight-decay-incr-style": (
        {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "linear"},
        {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "cosine"},
    ),
    "weight-decay-incr-steps": (
        {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "linear", "wd_incr_steps": 10},
        {"start_wd": 0.01, "end_wd": 0.02, "wd_incr_style": "linear", "wd_incr_steps": 20},
    ),
}


CHANGED = f"""
CHANGES = {CHANGES!r}
OUT["changed"] = {{}}
for name, (saved, run) in CHANGES.items():
    state = saved_state(saved)
    OUT["changed"][name] = dict(
        release=loaded(RELEASE, state, run, use_checkpoint_opt_param_scheduler=True)[0],
        fixed=loaded(S.load_state_dict, state, run, use_checkpoint_opt_param_scheduler=True)[0],
        checkpoint=scheduled(saved),
        arguments=scheduled(run),
    )
"""


def test_each_weight_decay_argument_changed(scheduler_alone):
    """Each weight-decay argument changed alone with --use-checkpoint-opt_param-scheduler: the release's
    load leaves the groups the arguments' weight decay; the fix, the checkpoint's, exactly."""
    assert set(scheduler_alone["changed"]) == set(CHANGES)
    for name, got in scheduler_alone["changed"].items():
        assert got["release"] == got["arguments"] != got["checkpoint"], (name, got)
        assert got["fixed"] == got["checkpoint"], (name, got)


UNCHANGED = """
cases = {
    "use-checkpoint, arguments unchanged": (dict(start_wd=0.01, end_wd=0.02, wd_incr_style="linear"),
                                           dict(start_wd=0.01, end_wd=0.02, wd_incr_style="linear"),
                                           dict(use_checkpoint_opt_param_scheduler=True)),
    "neither flag, arguments unchanged": ({}, {}, dict(use_checkpoint_opt_param_scheduler=False)),
    "override, weight decay changed": ({}, dict(start_wd=0.05, end_wd=0.05),
                                       dict(use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)),
}
out = {}
for name, (saved, run, flags) in cases.items():
    state = saved_state(saved)
    out[name] = [loaded(RELEASE, state, run, **flags), loaded(S.load_state_dict, state, run, **flags)]
old = {k: v for k, v in saved_state({}).items() if k not in ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")}
flags = dict(use_checkpoint_opt_param_scheduler=True)
run = dict(start_wd=0.05, end_wd=0.05)
out["a checkpoint without weight-decay fields"] = [loaded(RELEASE, old, run, **flags), loaded(S.load_state_dict, old, run, **flags)]
OUT["unchanged"] = out
"""


def test_where_the_release_is_right_the_fix_writes_the_same_bits(scheduler_alone):
    """Arguments unchanged (with or without --use-checkpoint-opt_param-scheduler), the override (the
    arguments win, as the release gives them), a checkpoint without weight-decay fields: every
    group's lr and weight decay and the scheduler's state, the same bits as the release's load."""
    assert len(scheduler_alone["unchanged"]) == 4, scheduler_alone["unchanged"]
    for name, (release, fixed) in scheduler_alone["unchanged"].items():
        assert fixed == release, (name, release, fixed)


UPSTREAM_ORDER = """
import importlib.util, inspect, sys
import megatron.core.optimizer_param_scheduler as m
from mcore_ckpt_fixes.fixes.scheduler_checkpoint_wd.runtime.core import probe

text = inspect.getsource(m)
step = "        self.step(increment=num_steps)\\n"
assert text.count(step) == 1
head, tail = text.split(step)
# upstream's order: every field restored first, the groups stepped last (the method ends the file)
assert tail.rstrip().splitlines()[-1].startswith(" " * 12), tail[-300:]
moved = head + tail.rstrip("\\n") + "\\n" + step
spec = importlib.util.spec_from_loader("upstream_order_scheduler", loader=None)
module = importlib.util.module_from_spec(spec)
exec(compile(moved, "upstream_order_scheduler", "exec"), module.__dict__)
OUT["upstream"] = {"release": list(probe(m)), "upstream": list(probe(module))}
"""


def test_probe_finds_upstream_order_not_needed(scheduler_alone):
    """The release's own class on a stand-in optimizer: True; the same source with the groups stepped
    after every field is restored (upstream's fix): False."""
    out = scheduler_alone["upstream"]
    assert out["release"][0] is True, out
    assert out["upstream"][0] is False, out


COMPOSED = """
from mcore_ckpt_fixes.engine.patching import layers

def stacked():
    return [fix for fix, _ in layers(S, "load_state_dict")]

def lr_groups(max_lr):
    return [{"lr": 0.0, "weight_decay": 0.0, "max_lr": max_lr, "min_lr": 0.001, "wd_mult": 1.0}]

def resume(flags, new):
    '''Saved with --lr 0.01 and weight decay 0.01; the run built with ``new``; the groups as the
    optimizer's load restores them (the saved max_lr); then the scheduler's load.'''
    opt = types.SimpleNamespace(param_groups=lr_groups(0.01))
    saved = S(opt, **BASE)
    saved.step(increment=3)
    opt = types.SimpleNamespace(param_groups=lr_groups(new["max_lr"]))
    run = S(opt, **{**BASE, **new}, **flags)
    opt.param_groups = lr_groups(0.01)
    run.load_state_dict(saved.state_dict())
    return bits(opt)

def expected(args):
    opt = types.SimpleNamespace(param_groups=lr_groups(args.get("max_lr", 0.01)))
    S(opt, **{**BASE, **args}).step(increment=3)
    return bits(opt)

NEW = dict(max_lr=0.02, start_wd=0.05, end_wd=0.05)
OVERRIDE = dict(use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
CHECKPOINT = dict(use_checkpoint_opt_param_scheduler=True)

def both():
    return {"override": resume(OVERRIDE, NEW), "checkpoint": resume(CHECKPOINT, NEW)}

out = {"stack": stacked(), "both": both(), "want": {"override": expected(NEW), "checkpoint": expected({})}}
mcore_ckpt_fixes.revert(["scheduler-override-group-lr"])
out["without_override_fix"] = {"stack": stacked(), **both()}
mcore_ckpt_fixes.apply()
out["again"] = {"stack": stacked(), **both()}
mcore_ckpt_fixes.revert(["scheduler-checkpoint-wd"])
out["without_wd_fix"] = {"stack": stacked(), **both()}
OUT["composed"] = out
"""


def test_composes_with_scheduler_override_group_lr(scheduler_alone):
    """Both fixes' layers on OptimizerParamScheduler.load_state_dict, in fixes.ORDER (this one on
    top): with the override the groups take the run's lr and weight decay, with the checkpoint's
    schedule its lr and weight decay; each fix reverted alone leaves the other's half working."""
    out = scheduler_alone["composed"]
    both = ["scheduler-override-group-lr", "scheduler-checkpoint-wd"]
    want = out["want"]
    assert out["stack"] == both and out["again"]["stack"] == both, out
    assert out["both"] == want and {k: out["again"][k] for k in want} == want, out
    alone = out["without_override_fix"]
    assert alone["stack"] == ["scheduler-checkpoint-wd"] and alone["checkpoint"] == want["checkpoint"], alone
    assert alone["override"] != want["override"], alone  # the saved max_lr: the other fix's bug, back
    alone = out["without_wd_fix"]
    assert alone["stack"] == ["scheduler-override-group-lr"] and alone["override"] == want["override"], alone
    assert alone["checkpoint"] != want["checkpoint"], alone  # the new arguments' weight decay: this bug, back


@pytest.fixture(scope="module")
def scheduler_alone(mcore_version):
    """Every part above in one fresh interpreter (the fixes at their defaults; the composition last,
    as it reverts them): their results by name."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    done = run_py(SETUP + CHANGED + UNCHANGED + UPSTREAM_ORDER + COMPOSED + "print(json.dumps(OUT))\n")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
