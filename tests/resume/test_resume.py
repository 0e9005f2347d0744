"""The resume check on this release line: with the fixes, every configuration resumes bit for bit;
without them, exactly the configurations whose fixes this release needs diverge, where the bug is.
Options whose resume is not meant to be exact (``expect="as-release"``): with the fixes, the resumed
run is the release's own resumed run bit for bit, or fails with the same error.

Each configuration is checked once per line (module-scoped): run A (the release's own uninterrupted
run, every fix off), then B (train, save and go on) and C (new processes: load and continue) with the
fixes at their defaults and with every fix off. B with the fixes on never resumes: it must be A, bit
for bit, over every step (the import changes nothing where the release works). What the CPU stand-ins are and why: mcore_ckpt_fixes/testing/gpt_job.py (torch's default
generator plays the CUDA generator Megatron's tracker swaps; Apex FusedAdam's interface, since
neither Apex nor Transformer Engine installs without CUDA; CUDA streams and ``device="cuda"``
allocations on the CPU).
"""

from __future__ import annotations

import re

import pytest

from conftest import megatron_version, resume_fail_text

from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.scenarios import MIMO_WORLD2_BUG
from mcore_ckpt_fixes.resume.configs import CONFIGS, KNOWN_BUG, KNOWN_FAILING, by_name
from mcore_ckpt_fixes.testing.job_config import Config

RNG_EXPERT = "rng:tracker:expert-parallel-rng"
MIMO = by_name("mimo-noncolocated")
# Held to the uninterrupted run (exact), or to the release's own resume (as-release).
EXACT = [c for c in CONFIGS if c.expect == "exact"]
AS_RELEASE = [c for c in CONFIGS if c.expect == resume.AS_RELEASE]
# Values compared per rank, at least: a GPT's parameters, optimizer state, scheduler and RNG streams
# number over 100; a MIMO rank's module is two linears (4 parameters: 61 values with everything).
# With each bucket padded to 65536 elements the small GPT's state lies in rank 0's halves: rank 1
# holds no main parameter or optimizer state (over 70 values: parameters, scheduler, RNG, losses).
MIN_VALUES = {MIMO.name: 50, "dense-dp2-padded-buckets": 70}


def _needs_training():
    why = resume.not_applicable()
    if why:
        version = megatron_version()
        assert version is not None and version.release < (0, 17), f"megatron.training missing on {version}: {why}"
        pytest.skip(f"not applicable on {version}: {why}")


# Attribution, on one configuration and one line (one more save and resume: the same code runs
# every configuration's "only" mode): with only the fixes it declares (MCORE_CKPT_FIXES=
# mimo-optimizer, every other fix off), the MIMO configuration resumes exactly on 0.18, where with
# every fix off it cannot even save.
ATTRIBUTED = (MIMO.name, (0, 18))


def _attributed_here(cfg):
    version = megatron_version()
    return cfg.name == ATTRIBUTED[0] and version is not None and version.release[:2] == ATTRIBUTED[1]


_CACHE: dict = {}


def _checked(cfg, modes=None):
    modes = modes or (("on", "off", resume.ONLY) if _attributed_here(cfg) else ("on", "off"))
    if cfg.name not in _CACHE:
        resume.prepare()
        _CACHE[cfg.name] = resume.check(cfg, modes=modes)
    out = _CACHE[cfg.name]
    if "not_applicable" in out:
        # Only a release without MimoOptimizer (0.16 has no megatron.core.models.mimo) may lack it.
        assert cfg.requires and resume.missing_requirement(cfg), out
        pytest.skip(f"{cfg.name} not applicable here: {out['not_applicable']}")
    return out


def _each_way(cfg, mode_out):
    """(options, verdict) per way run C resumed: one, or one per ``cfg.resume_args``."""
    if not cfg.resume_args:
        return [((), mode_out)]
    assert [tuple(w["args"]) for w in mode_out["ways"]] == list(cfg.resume_args), mode_out["ways"]
    return [(tuple(w["args"]), w) for w in mode_out["ways"]]


@pytest.mark.parametrize("cfg", EXACT, ids=[c.name for c in EXACT])
def test_exact_with_the_fixes(cfg):
    _needs_training()
    out = _checked(cfg)["on"]
    assert out["verdict"] == "exact", resume_fail_text(out)
    for args, way in _each_way(cfg, out):
        assert way["verdict"] == "exact", (args, resume_fail_text(way))
        _assert_every_rank_compared(cfg, way)


def _assert_every_rank_compared(cfg, out):
    assert len(out["ranks"]) == cfg.world
    for r in out["ranks"]:
        assert r["steps"] == list(range(resume.RESUME_AT + 1, resume.STEPS + 1))  # every resumed step compared
        # parameters, optimizer state, scheduler, RNG streams, losses
        assert r["n_compared"] > MIN_VALUES.get(cfg.name, 100), r["n_compared"]
        # A checkpoint the fixed release wrote itself loads without a word from the fixes.
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c.name for c in CONFIGS])
def test_a_run_that_never_resumes_is_unchanged_by_the_fixes(cfg):
    """B with every fix at its default (it saves after step 2 and trains on) against the release's
    own run A (every fix off, no checkpoint): every loss of every step, every parameter, optimizer
    tensor and scalar, the scheduler and every RNG stream, on every rank, the same bits."""
    _needs_training()
    out = _checked(cfg)["on"]
    unchanged = out["unchanged"]
    assert unchanged["verdict"] == "exact", resume_fail_text(unchanged)
    assert len(unchanged["ranks"]) == cfg.world
    for r in unchanged["ranks"]:
        assert r["steps"] == list(range(1, resume.STEPS + 1)), r["steps"]  # every step, the saved ones too
        assert r["n_compared"] > MIN_VALUES.get(cfg.name, 100), r["n_compared"]
    if cfg.job in (Config.job, "mcore_ckpt_fixes.resume.mimo:run"):  # they record which Adam ran (no Apex or TE here)
        assert _checked(cfg)["optimizer"] == ("FusedAdam stand-in" if cfg.fused_adam else "torch AdamW"), cfg


@pytest.mark.parametrize("cfg", EXACT, ids=[c.name for c in EXACT])
def test_without_the_fixes_diverges_exactly_where_a_needed_fix_is(cfg):
    _needs_training()
    out = _checked(cfg)
    off = out["off"]
    if cfg.resume_args:
        _assert_ways_without_the_fixes(cfg, out)
        return
    if "torch-adam-step" in out["needed_here"]:
        _fails_on_the_fresh_optimizer(off)
        return
    if out["needed_here"] == ["mimo-optimizer"]:
        _assert_mimo_without_the_fix(off)
        return
    if out["needed_here"] == ["dist-optim-state"]:
        _assert_trainer_requests_without_the_fix(cfg, off)
        return
    if out["needed_here"] == ["param-group-identity"]:
        # The decoupled group's twin (alike but for max_lr) resumes with the decoupled max_lr: the
        # first resumed step's loss is exact, its update runs at the wrong learning rate.
        _assert_optimizer_state_silently_wrong(off, state=":max_lr")
        return
    if out["needed_here"] == ["fully-reshardable-buckets"]:
        # Parameters after the first bucket are saved from other offsets of the gathered state: the
        # load restores other main values and moments, silently.
        _assert_optimizer_state_silently_wrong(off)
        return
    if out["needed_here"] == ["rerun-state-strict-load"]:
        _assert_strict_load_rejects_the_idle_rerun_state(off)
        return
    if out["needed_here"] == ["legacy-save-writers"]:
        _assert_legacy_file_never_written(off)
        return
    if out["needed_here"] == ["dp-reshardable-padding"]:
        _assert_all_padding_shard_refused(off)
        return
    assert off["verdict"] != "error", resume_fail_text(off)
    if not out["needed_here"]:
        assert off["verdict"] == "exact", resume_fail_text(off)
        return
    assert out["needed_here"] == ["rng-under-ep"], out["needed_here"]
    # rng-under-ep: every EP rank > 0 resumes on EP rank 0's RNG streams. Its first resumed step
    # already differs (dropout and router noise drawn from the wrong stream) and its expert-parallel
    # stream ends elsewhere; an EP-rank-0 rank resumes its own state, so its first resumed step is
    # exact (later ones may differ: gradients are reduced across the EP ranks).
    first = resume.RESUME_AT + 1
    assert off["verdict"] == "inexact"
    for r in off["ranks"]:
        if r["ep"] > 0:
            assert r["first_step"] == first, resume_fail_text(off)
            assert RNG_EXPERT in r["differ_all"], r["differ_all"]
        else:
            assert r["first_step"] != first, resume_fail_text(off)


def _assert_strict_load_rejects_the_idle_rerun_state(off):
    """0.18+, every fix off: the save writes the rerun machine's idle entry, load_checkpoint leaves
    it out of its request (no rerun to restore) and raise_all counts it missing on every rank
    (NVIDIA/Megatron-LM#7428)."""
    assert off["verdict"] == "error", resume_fail_text(off)
    # The error's last line (what the check reports); its first line is in the traceback.
    assert off["error"] == "resume run: rank 0: Missing keys (for all ranks): {'rerun_state_machine_state'}.", off
    title = "CheckpointingException: Some keys found in the checkpoint are missing in the provided sharded state dict."
    assert title in off["detail"] and "load_checkpoint" in off["detail"], off["detail"][-2000:]


def _assert_all_padding_shard_refused(off):
    """--ddp-pad-buckets-for-high-nccl-busbw, every fix off: rank 1's half of a bucket is all
    padding, and the stopped run's first save stops there (NVIDIA/Megatron-LM#6191)."""
    assert off["verdict"] == "error", resume_fail_text(off)
    assert off["error"] == "save run: rank 1: AssertionError: empty bucket encountered", off["error"]
    assert "sharded_param_state_dp_reshardable" in off["detail"] and "save_checkpoint" in off["detail"], off["detail"]


def _assert_legacy_file_never_written(off):
    """TP=2, EP=1, expert TP=1, legacy torch format, every fix off (0.17.x): only expert-DP rank 0
    (TP rank 0) writes, the save returns and records the iteration, and the resumed run's TP rank 1
    finds no file to load: Megatron prints why and exits in load_checkpoint."""
    assert off["verdict"] == "error", resume_fail_text(off)
    expected = (
        r"resume run: rank 1: RuntimeError: load_checkpoint exited: could not load the checkpoint / "
        r"\[Errno 2\] No such file or directory: '[^']*/iter_0000002/mp_rank_01/model_optim_rng\.pt'"
    )
    assert re.fullmatch(expected, off["error"]), off["error"]


def _assert_mimo_without_the_fix(off):
    """0.17.x and 0.18.x: the two modules' DistributedOptimizers name their objects alike
    (``optimizer.distributed.dp_group_idx_0...``), so Megatron's save-time validation on global rank
    0 rejects the checkpoint: the stopped run cannot save at all (the round trips' ``world2`` error;
    on 0.17 this comes before the load-side defects). 0.19 writes per-module keys itself: there the
    configuration is not counted as needing the fix and resumes exactly without it (above)."""
    assert off["verdict"] == "error", resume_fail_text(off)
    expected = "save run: rank 0: mcore_ckpt_fixes.resume.mimo._Failed: save (raised on rank 0): "
    assert off["error"] == expected + " ".join(MIMO_WORLD2_BUG.error.split()), off["error"]


def _assert_trainer_requests_without_the_fix(cfg, off):
    """dist-optim-state's defects, every fix off. Bare requests (no metadata) ask for
    fully_sharded_model_space, which this release cannot describe: the stopped run cannot save. A
    load request built without is_loading on the resumed run's fresh optimizer restores no Adam
    moments and says nothing: the first resumed step runs on the loaded parameters (its loss is
    exact), its update starts the moments from zero, and from the next step on every rank differs."""
    if cfg.optimizer_requests == "bare":
        assert off["verdict"] == "error", resume_fail_text(off)
        expected = "CheckpointingException: ShardedTensor.flattened_range is not supported."
        assert off["error"] == f"save run: rank 0: megatron.core.dist_checkpointing.core.{expected}", off["error"]
        return
    assert cfg.optimizer_requests == "without-is-loading", cfg
    _assert_optimizer_state_silently_wrong(off)


def _assert_optimizer_state_silently_wrong(off, state=":exp_avg_sq"):
    """The load completed and restored other optimizer state (main values, moments) than was saved:
    the first resumed step runs on the loaded model parameters (its loss is exact), its update is
    wrong, and from the next step on every rank differs."""
    assert off["verdict"] == "inexact", resume_fail_text(off)
    for r in off["ranks"]:
        assert r["first_step"] == resume.RESUME_AT + 2, resume_fail_text(off)
        assert any(n.endswith(state) for n in r["differ_all"]), r["differ_all"]


STRICT_ALL_MISSING = (
    "megatron.core.dist_checkpointing.core.CheckpointingException: Some keys found in the checkpoint are "
    "missing in the provided sharded state dict. Missing keys (for all ranks): {'rerun_state_machine_state'}."
)


def _assert_ways_without_the_fixes(cfg, out):
    if cfg.name == "dense-dp2-new-lr-checkpoint-scheduler":
        _assert_new_lr_refused_from_019(cfg, out)
        return
    _assert_strictness_values_without_the_fixes(cfg, out)


def _assert_new_lr_refused_from_019(cfg, out):
    """A new --lr / --min-lr with --use-checkpoint-opt-param-scheduler, every fix off: 0.17 and 0.18
    match the saved param groups without their learning rates and go on with the checkpoint's schedule,
    exactly; 0.19 matches them by max_lr / min_lr and every rank stops in load_checkpoint (fix
    param-group-identity; catalogued as lr-change-resume-group-mismatch)."""
    ((args, way),) = _each_way(cfg, out["off"])
    if megatron_version().release < (0, 19):
        assert way["verdict"] == "exact", resume_fail_text(way)
        assert out["needed_here"] == [], out["needed_here"]
        return
    assert out["needed_here"] == ["param-group-identity"], out["needed_here"]
    assert way["verdict"] == "error", resume_fail_text(way)
    assert way["errors"] == [[rank, NEW_LR_GROUPS] for rank in range(cfg.world)], way["errors"]
    assert "load_checkpoint" in way["detail"], way["detail"][-2000:]


def _assert_strictness_values_without_the_fixes(cfg, out):
    """Every --dist-ckpt-strictness value that hands load_checkpoint the loaded state, every fix off.
    On 0.18+ the release writes the rerun machine's idle entry and load_checkpoint leaves it out of
    its request: raise_all stops every rank on it (rerun-state-strict-load's bug), log_all only logs
    it, ignore_all does not look, and the *_unexpected values and the default do not compare the
    request with the whole checkpoint; each of those resumes exactly. 0.17 writes no idle entry:
    every value resumes exactly."""
    assert cfg.name == "dense-dp2-strictness-values", cfg.name
    for (option, value), way in _each_way(cfg, out["off"]):
        assert option == "--dist-ckpt-strictness", option
        if value == "raise_all" and out["needed_here"] == ["rerun-state-strict-load"]:
            assert way["verdict"] == "error", resume_fail_text(way)
            assert way["errors"] == [[rank, STRICT_ALL_MISSING] for rank in range(cfg.world)], way["errors"]
            assert "load_checkpoint" in way["detail"], way["detail"][-2000:]
        else:
            assert way["verdict"] == "exact", (value, resume_fail_text(way))
    assert out["needed_here"] == ([] if megatron_version().release < (0, 18) else ["rerun-state-strict-load"])


# -- options whose resume is not meant to equal the uninterrupted run ---------------------------------

# megatron.training's load_checkpoint takes dist_checkpointing.load's result as the state dict; with
# return_unexpected / return_all it is (state dict, missing keys, unexpected keys).
RETURNED_TUPLE = "AttributeError: 'tuple' object has no attribute 'get'"
# 0.19 matches the saved param groups to the new ones by their max_lr / min_lr (catalogued:
# lr-change-resume-group-mismatch); 0.17 and 0.18 take the checkpoint's schedule, as the option says.
NEW_LR_GROUPS = "KeyError: (None, 0.02, 0.002, None, None, 1.0, 1.0, False, False)"


def _release_error(args):
    """The error every rank of the release's own resume stops with under these options, or None."""
    if args[:1] == ("--dist-ckpt-strictness",):
        return RETURNED_TUPLE
    return None


@pytest.mark.parametrize("cfg", AS_RELEASE, ids=[c.name for c in AS_RELEASE])
def test_resumes_as_the_release_with_the_fixes(cfg):
    """With the fixes, each way of resuming is the release's own (run C without them) bit for bit on
    every rank: every resumed loss, parameter, optimizer tensor and scalar, the scheduler, every RNG
    stream and the iteration load_checkpoint returned; where the release fails, the same error on
    the same ranks. A dense DP=2 job: no fix is needed, so nothing here may change with them."""
    _needs_training()
    out = _checked(cfg)
    assert out["needed_here"] == [], out["needed_here"]
    on = out["on"]
    assert on["verdict"] == resume.AS_RELEASE, resume_fail_text(on)
    for args, way in _each_way(cfg, on):
        assert way["verdict"] == resume.AS_RELEASE, (args, resume_fail_text(way))
        error = _release_error(args)
        if error:
            assert way["same"] == "error", (args, way)
            assert way["errors"] == [[rank, error] for rank in range(cfg.world)], (args, way["errors"])
        else:
            assert way["same"] == "bits", (args, way)
            _assert_every_rank_compared(cfg, way)


@pytest.mark.parametrize("cfg", AS_RELEASE, ids=[c.name for c in AS_RELEASE])
def test_the_release_resumes_as_each_option_says(cfg):
    """The release's own resume (every fix off) against its uninterrupted run: each option reached
    the resumed run and did what it says, so that the comparison above compares resumes that differ
    from the uninterrupted one where they should. --no-load-optim: the model loads (step 3 exact),
    the optimizer and scheduler start afresh (step 4 and the moments differ); --no-load-rng: every
    stream starts from the seed (step 3 differs); --finetune: only the model loads, iteration 0;
    --use-checkpoint-opt-param-scheduler: exact, with the same schedule and, on 0.17 and 0.18, with a
    new --lr / --min-lr too (the checkpoint's wins)."""
    _needs_training()
    for args, way in _each_way(cfg, _checked(cfg)["off"]):
        error = _release_error(args)
        if error:
            assert way["verdict"] == "error" and way["errors"] == [[r, error] for r in range(cfg.world)], way
            continue
        want = {
            ("--no-load-optim",): (4, 2, {"scheduler:num_steps", "optim0:group0:step", "optim0:group0:lr"}),
            ("--no-load-rng",): (3, 2, {"rng:python", "rng:numpy", "rng:torch", "rng:tracker:model-parallel-rng"}),
            ("--finetune",): (3, 0, {"scheduler:num_steps", "optim0:group0:step", "rng:numpy"}),
        }.get(args, (None, 2, set()))
        first, iteration, differing = want
        assert way["verdict"] == ("exact" if first is None else "inexact"), (args, resume_fail_text(way))
        for r in way["ranks"]:
            assert (r["first_step"], r["iteration"]) == (first, iteration), (args, r)
            assert differing <= set(r["differ_all"]), (args, sorted(differing - set(r["differ_all"])))
            if first is not None:
                assert any(n.endswith(":exp_avg_sq") for n in r["differ_all"]), (args, r["differ_all"])


def _rank(losses, state, iteration=2, rank=0):
    return {
        "coords": {"rank": rank, "tp": 0, "ep": 0, "dp": rank},
        "losses": losses,
        "state": state,
        "iteration": iteration,
    }


@pytest.mark.one_line
def test_the_comparison_with_the_release_sees_any_difference():
    """The as-release verdict can fail: the same results compare as the release's, and each of these
    changes is caught and named: one bit of one tensor on one rank, one loss one float apart, the
    iteration load_checkpoint returned, an error only one side raised, two different errors. Two
    errors that differ only in the checkpoint directory each mode saved to are the same error.

    Also tried on the configuration's real runs (0.19.2): with the resumed job drawing one more
    NumPy number when the fixes are on (a deliberate change to gpt_job.py, not kept), every way of
    dense-dp2-resume-options that resumes became ``differs`` from step 3 on both ranks, and the
    test above failed."""
    import dataclasses
    import math

    import torch

    cfg = dataclasses.replace(by_name("dense-dp2-resume-options"), resume_args=())

    def ranks(bit=False, loss=1.5, iteration=2):
        w = torch.arange(6, dtype=torch.float32)
        if bit:
            w.view(torch.int32)[3] ^= 1
        return [
            _rank({3: 1.5, 4: 1.25}, {"param:w": torch.zeros(3)}),
            _rank({3: 1.5, 4: loss}, {"param:w": w}, iteration, 1),
        ]

    def verdict(fixed, release):
        return resume._same_as_release(cfg, fixed, release)

    assert verdict(ranks(), ranks())["verdict"] == "as-release"
    flipped = verdict(ranks(bit=True), ranks())
    assert flipped["verdict"] == "differs" and [r["differ"] for r in flipped["ranks"]] == [[], ["param:w"]], flipped
    ulp = verdict(ranks(loss=math.nextafter(1.25, 2.0)), ranks())
    assert ulp["verdict"] == "differs" and ulp["ranks"][1]["first_step"] == 4, ulp
    loaded = verdict(ranks(iteration=0), ranks())
    assert loaded["verdict"] == "differs" and loaded["ranks"][1]["differ"] == ["load:iteration"], loaded

    def failed(text):
        return [{"coords": {"rank": r}, "error": text, "detail": "..."} for r in range(2)]

    where = resume._ckpt_prefix(cfg, "on") + "abc123/iter_0000002"
    there = resume._ckpt_prefix(cfg, "off") + "xyz789/iter_0000002"
    assert verdict(failed(f"OSError: {where}"), failed(f"OSError: {there}"))["same"] == "error"
    assert verdict(failed("KeyError: 1"), failed("KeyError: 2"))["verdict"] == "differs"
    assert verdict(failed("KeyError: 1"), ranks())["verdict"] == "differs"
    assert (
        verdict(ranks(), failed("KeyError: 1"))["error"]
        == "resumed, where the release failed (resume run: rank 0: KeyError: 1)"
    )


@pytest.mark.one_line
def test_resuming_several_ways_in_one_world_does_not_depend_on_the_order():
    """Run C resumes one checkpoint several ways in the same processes, each from a newly built and
    seeded job: in the reverse order every way gives the same bits (or error) as in the configured
    order, so no way inherits what one before it left behind (and the first way of each order runs
    in processes that did nothing before it)."""
    import dataclasses
    import shutil
    import tempfile

    _needs_training()
    resume.prepare()
    cfg = AS_RELEASE[0]
    backwards = dataclasses.replace(cfg, resume_args=tuple(reversed(cfg.resume_args)))
    ckpt_dir = tempfile.mkdtemp(prefix=resume._ckpt_prefix(cfg, "off"))
    try:
        runs = [resume._world(cfg, "save", ckpt_dir, resume.MODES["off"], "cpu", 240.0)]
        runs += [resume._world(c, "resume", ckpt_dir, resume.MODES["off"], "cpu", 240.0) for c in (cfg, backwards)]
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    assert [error for _, error, _ in runs] == [None] * 3, runs
    forwards, reverse = resume._ways(runs[1][0]), resume._ways(runs[2][0])[::-1]
    for args, fwd, rev in zip(cfg.resume_args, forwards, reverse):
        way = resume._same_as_release(cfg, fwd, rev)
        assert way["verdict"] == resume.AS_RELEASE, (
            args,
            way.get("error"),
            [r["differ"] for r in way.get("ranks", [])],
        )


def test_only_the_needed_fixes_resume_exactly():
    """The fixes a configuration declares are all it needs: with only those on, exact on every rank."""
    _needs_training()
    if not _attributed_here(MIMO):
        pytest.skip(f"attribution runs for {ATTRIBUTED[0]} on {'.'.join(map(str, ATTRIBUTED[1]))} only (test time)")
    out = _checked(MIMO)
    assert out["needed_here"] == ["mimo-optimizer"], out["needed_here"]  # without it, no save (above)
    assert resume.mode_env(MIMO, resume.ONLY) == {"MCORE_CKPT_FIXES": "mimo-optimizer"}
    only = out[resume.ONLY]
    assert only["verdict"] == "exact", resume_fail_text(only)
    assert len(only["ranks"]) == MIMO.world
    assert [r["n_compared"] for r in only["ranks"]] == [r["n_compared"] for r in out["on"]["ranks"]]


def test_mimo_ranks_train_their_own_module():
    """The MIMO configuration's ranks: language model on 0, vision encoder on 1, each compared on its
    parameters, its distributed optimizer's fp32 shards and moments, the scheduler and every stream."""
    _needs_training()
    out = _checked(MIMO)["on"]
    assert [r["module"] for r in out["ranks"]] == ["language", "vision"], out["ranks"]
    for r in out["ranks"]:
        _assert_mimo_compares_everything(set(r["compared_all"]))


def _assert_mimo_compares_everything(names):
    for part in ("param:fc1.weight", "optim0:group0:main0", "state0:exp_avg_sq", "scheduler:num_steps", "rng:cuda"):
        assert any(part in n for n in names), (part, sorted(names))
    assert {"rng:python", "rng:numpy", "rng:torch", "rng:tracker:model-parallel-rng"} <= names, sorted(names)


def test_mimo_not_applicable_without_mimo_optimizer():
    """A release without MimoOptimizer reports the configuration as not applicable, with the reason;
    it is never run or counted as exact. Shown with a module this release lacks in MimoOptimizer's
    place (on 0.16, which has neither, the whole check is not applicable: test below)."""
    import dataclasses

    _needs_training()
    assert not resume.missing_requirement(MIMO)  # megatron.core.models.mimo ships with megatron.training
    cfg = dataclasses.replace(MIMO, requires="megatron.core.models.mimo.no_such_optimizer")
    out = resume.check(cfg)
    assert out["not_applicable"].startswith("megatron.core.models.mimo.no_such_optimizer does not import"), out
    assert "on" not in out and "off" not in out, out


FRAMEWORK_CONFIGS = {
    "moe-ep2-bridge": "test_bridge_resume.py",
    "moe-ep2-verl": "test_verl_resume.py",
    "moe-ep2-ms-swift": "test_ms_swift_resume.py",
}


@pytest.mark.parametrize("name", sorted(FRAMEWORK_CONFIGS))
def test_framework_configuration_not_applicable_without_the_framework(name):
    """Where the framework is not installed (every release line), its configuration says so with the
    reason instead of running; tests/frameworks runs it in the framework's own line."""
    _needs_training()
    cfg = by_name(name)
    if not resume.missing_requirement(cfg):
        pytest.skip(f"{cfg.requires} imports here: tests/frameworks/{FRAMEWORK_CONFIGS[name]} runs {name}")
    out = resume.check(cfg)
    assert out["not_applicable"].startswith(f"{cfg.requires} does not import here"), out
    assert "on" not in out and "off" not in out, out


def _fails_on_the_fresh_optimizer(off):
    """torch's Adam (Megatron's fallback without Apex or Transformer Engine) with every fix off:
    load_checkpoint into the freshly built optimizer of the resumed run stops in
    DistributedOptimizer.state_dict's ``assert len(steps) == 1`` (no parameter has a step before
    the first one): torch-adam-step's defect (a), catalogued as ``torch-adam-fresh-load``."""
    assert off["verdict"] == "error", resume_fail_text(off)
    assert off["error"].startswith("resume run: rank 0: AssertionError"), off["error"]
    frames = [line for line in off["detail"].splitlines() if line.strip().startswith("File ")]
    assert "distrib_optimizer.py" in frames[-1] and frames[-1].endswith("in state_dict"), frames[-3:]
    assert any("load_checkpoint" in f for f in frames), frames


def test_no_configuration_is_known_to_fail():
    """A configuration that cannot resume for a catalogued, unfixed reason is listed apart
    (KNOWN_FAILING, reported by ``selftest --resume`` beside its verdict); none is at present."""
    assert KNOWN_FAILING == () and KNOWN_BUG == {}


def test_the_rng_stand_in_really_swaps_what_dropout_draws():
    """Inside ``tracker.fork(name)`` CPU ops must draw from that stream, after it from where they
    were, and the CPU generator must not move: a bookkeeping-only fork (draws always from one
    generator) would make every stream look restored while nothing is drawn from it."""
    _needs_training()
    import torch

    from mcore_ckpt_fixes.testing.launcher import run_world, values

    if torch.cuda.is_available():
        pytest.skip("the stand-in is used only without CUDA")
    (got,) = values(run_world("mcore_ckpt_fixes.testing._rng_standin:fork_draws", 1, timeout=120))
    stream, outer = torch.Generator().manual_seed(2), torch.Generator().manual_seed(1)
    assert torch.equal(got["inside"], torch.rand(8, generator=stream))  # drawn from the tracker's stream
    assert torch.equal(got["after"], torch.rand(8, generator=outer))  # the default stream, untouched by the fork
    assert torch.equal(got["cpu_before"], got["cpu_after"])  # the CPU generator is a stream of its own
    assert (got["dropped"] == 0).any() and (got["dropped"] != 0).any()  # dropout drew there too


def test_not_applicable_without_megatron_training():
    """0.16.x wheels ship no megatron.training: the check says so instead of passing."""
    if not resume.not_applicable():
        pytest.skip("megatron.training imports on this line (the check runs: tests above)")
    from conftest import run_cli

    proc = run_cli(["selftest", "--resume"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not applicable here: megatron.training does not import" in proc.stderr


def test_selftest_resume_bad_nproc_is_one_line_exit_2():
    """No configuration for that world size: one clear line, exit 2, nothing run (where the check runs)."""
    _needs_training()
    from conftest import run_cli

    proc = run_cli(["selftest", "--resume", "--nproc", "3"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "mcore-ckpt-fixes selftest --resume: no configuration runs on 3 ranks"
    assert proc.stdout == ""


def test_attribution_without_resume_is_one_line_exit_2():
    """``--attribution`` belongs to the resume check: alone it says so and runs nothing."""
    from conftest import run_cli

    proc = run_cli(["selftest", "--attribution"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == "mcore-ckpt-fixes selftest: --attribution goes with --resume"
    assert proc.stdout == ""
