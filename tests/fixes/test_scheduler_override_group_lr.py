"""scheduler-override-group-lr: both halves on the affected CI lines (0.16.1 through
dist_checkpointing; 0.17.1, 0.18.2 and 0.19.2 also through megatron.training), one warm world each.
0.19 loads a changed --lr only with param-group-identity, and only where the groups differ in more
than their learning rates: there the round trip has no decoupled group.

World 2 (gloo on CPU): the distributed optimizer with a decoupled group and Megatron's scheduler saved
with --lr 0.01 --min-lr 0.001 --decoupled-lr 0.03, loaded with --lr 0.02 --min-lr 0.002
--decoupled-lr 0.05 and --override-opt-param-scheduler; every group's max_lr, min_lr and lr against
a scheduler with the new arguments after the same steps, no load. See
mcore_ckpt_fixes/fixes/scheduler_override_group_lr/checks/core.py.
"""

import pytest
from fix_worlds import both_halves

from mcore_ckpt_fixes.fixes.scheduler_override_group_lr import FIX
from mcore_ckpt_fixes.fixes.scheduler_override_group_lr.checks import scenarios as sc
from mcore_ckpt_fixes.fixes.scheduler_override_group_lr.checks.core import NEW, OLD, lrs

CORE = "mcore_ckpt_fixes.fixes.scheduler_override_group_lr.checks.core"
MODULE = "megatron.core.optimizer_param_scheduler"


@pytest.fixture(scope="module")
def worlds(tmp_path_factory, mcore_version):
    # The fix-off half as selftest and the GPU check run it: every fix off but param-group-identity,
    # without which 0.19 stops in the optimizer's load before the scheduler is read.
    return both_halves(FIX, f"{CORE}:round_trip", sc.SCENARIOS[0].off_env(), tmp_path_factory, mcore_version)


def _paths(mcore_version):
    return ("dist/", "training/") if mcore_version.release >= (0, 17) else ("dist/",)


def test_unpatched_groups_keep_the_saved_schedule(worlds, mcore_version):
    for rank, r in enumerate(worlds[False]):
        assert r["fix_state"] == {MODULE: "disabled"}, (rank, r)
        assert (r["phase"], r["error"]) == (sc.OLD_SCHEDULE.phase, sc.OLD_SCHEDULE.error), (rank, r.get("traceback"))
        # Every group's max_lr is still a saved value, none the new one (silently: the load completed).
        saved = {OLD["lr"], OLD["decoupled_lr"]}  # (0.19 has no decoupled group here: checks/core.py's lrs)
        assert {r["groups"][k] for k in r["groups"] if k.endswith("/max_lr")} <= saved, r["groups"]
        for path in _paths(mcore_version):
            assert any(k.startswith(path) and d != 0.0 for k, d in r["max_delta"].items()), (path, r["max_delta"])
    assert sc.SCENARIOS[0].bug_for(mcore_version).seen_in(worlds[False])


def test_patched_groups_follow_the_new_schedule(worlds, mcore_version):
    for rank, r in enumerate(worlds[True]):
        assert r["error"] is None, (rank, r["phase"], r["error"], r.get("traceback"))
        assert r["fix_state"] == {MODULE: "applied"}, (rank, r["fix_state"])
        assert set(r["max_delta"].values()) == {0.0}, r["max_delta"]
        assert {p for p in _paths(mcore_version)} == {k.split("/")[0] + "/" for k in r["max_delta"]}, r["max_delta"]
        # The decoupled group keeps its own new value; the others take the new --lr.
        max_lrs = sorted(v for k, v in r["groups"].items() if k.endswith("/max_lr"))
        assert set(max_lrs) == {v for v in (lrs(NEW)["lr"], lrs(NEW)["decoupled_lr"]) if v is not None}, r["groups"]


def test_without_override_nothing_changes(mcore_version):
    """Without --override-opt-param-scheduler the groups keep what the load restored, as the release."""
    if mcore_version not in FIX.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {FIX.affected}")
    import types

    import mcore_ckpt_fixes

    mcore_ckpt_fixes.apply()
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = types.SimpleNamespace(param_groups=[{"lr": 0.0, "weight_decay": 0.0, "max_lr": 0.01, "min_lr": 0.0}])
    kwargs = dict(init_lr=0.0, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=10, lr_decay_style="constant",
                  start_wd=0.0, end_wd=0.0, wd_incr_steps=10, wd_incr_style="constant")  # fmt: skip
    saved = OptimizerParamScheduler(opt, max_lr=0.01, **kwargs).state_dict()
    run = OptimizerParamScheduler(opt, max_lr=0.01, use_checkpoint_opt_param_scheduler=True, **kwargs)
    opt.param_groups = [{"lr": 0.0, "weight_decay": 0.0, "max_lr": 0.03, "min_lr": 0.0}]  # as a load restores them
    run.load_state_dict(saved)
    assert opt.param_groups[0]["max_lr"] == 0.03 and opt.param_groups[0]["lr"] == 0.03, opt.param_groups
