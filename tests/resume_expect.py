"""What the resume check must find on a release line, per configuration and mode: the expectations
that tests/resume/test_resume.py (CPU) and tests/gpu/test_cuda_resume.py (CUDA) both hold a
``resume.check`` result to, so that the GPU run asserts exactly what the CPU run does.

``out`` is ``resume.check(cfg)``'s result: ``on`` (the fixes at their defaults, with ``unchanged``:
the run that never resumes), ``off`` (every fix off) and ``needed_here`` (the fixes this release
needs for the configuration).
"""

from __future__ import annotations

import re

from conftest import megatron_version, resume_fail_text

from mcore_ckpt_fixes.fixes.mimo_optimizer.checks.scenarios import MIMO_WORLD2_BUG
from mcore_ckpt_fixes.resume import check as resume
from mcore_ckpt_fixes.resume.configs import by_name

RNG_EXPERT = "rng:tracker:expert-parallel-rng"
# Values compared per rank, at least: a GPT's parameters, optimizer state, scheduler and RNG streams
# number over 100; a MIMO rank's module is two linears (4 parameters: 61 values with everything).
# With each bucket padded to 65536 elements the small GPT's state lies in rank 0's halves: rank 1
# holds no main parameter or optimizer state, and the steps of its two empty groups are not compared
# (gpt_job.snapshot): 70 values (parameters, the groups' settings, scheduler, RNG, losses).
# A pipeline stage holds its own layers only (the first stage one layer and the embeddings), and
# under DP=2 the distributed optimizer's half of their state: over 60.
MIN_VALUES = {by_name("mimo-noncolocated").name: 50, "dense-dp2-padded-buckets": 69}
MIN_VALUES_PER_STAGE = 60


def min_values(cfg) -> int:
    return MIN_VALUES.get(cfg.name, MIN_VALUES_PER_STAGE if cfg.pp > 1 else 100)


def each_way(cfg, mode_out):
    """(options, verdict) per way run C resumed: one, or one per ``cfg.resume_args``."""
    if not cfg.resume_args:
        return [((), mode_out)]
    assert [tuple(w["args"]) for w in mode_out["ways"]] == list(cfg.resume_args), mode_out["ways"]
    return [(tuple(w["args"]), w) for w in mode_out["ways"]]


def assert_every_rank_compared(cfg, out):
    assert len(out["ranks"]) == cfg.world
    for r in out["ranks"]:
        assert r["steps"] == list(range(resume.RESUME_AT + 1, resume.STEPS + 1))  # every resumed step compared
        # parameters, optimizer state, scheduler, RNG streams, losses
        assert r["n_compared"] > min_values(cfg), r["n_compared"]
        # A checkpoint the fixed release wrote itself loads without a word from the fixes.
        assert not [w for w in r["load_warnings"] if "MegatronPatchWarning" in w], r["load_warnings"]


def assert_exact_with_the_fixes(cfg, out):
    """With the fixes, every way run C resumed is the uninterrupted run A, bit for bit, on every rank."""
    on = out["on"]
    assert on["verdict"] == "exact", resume_fail_text(on)
    for args, way in each_way(cfg, on):
        assert way["verdict"] == "exact", (args, resume_fail_text(way))
        assert_every_rank_compared(cfg, way)


def assert_unchanged_by_the_fixes(cfg, out):
    """B with every fix at its default (it saves after step 2 and trains on) against the release's
    own run A (every fix off, no checkpoint): every loss of every step, every parameter, optimizer
    tensor and scalar, the scheduler and every RNG stream, on every rank, the same bits."""
    # A run that stopped before B was compared has no "unchanged": its error is what to show.
    assert "unchanged" in out["on"], resume_fail_text(out["on"])
    unchanged = out["on"]["unchanged"]
    assert unchanged["verdict"] == "exact", resume_fail_text(unchanged)
    assert len(unchanged["ranks"]) == cfg.world
    for r in unchanged["ranks"]:
        assert r["steps"] == list(range(1, resume.STEPS + 1)), r["steps"]  # every step, the saved ones too
        assert r["n_compared"] > min_values(cfg), r["n_compared"]


def assert_without_the_fixes(cfg, out):
    """Every fix off: exactly the configurations whose fixes this release needs diverge, where
    each one's bug is (the error, or the first step and values that differ); the others are exact."""
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
        if cfg.pp > 1:
            _assert_padding_past_the_unpadded_end_refused(off)
        else:
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
    # exact (later ones may differ: gradients are reduced across the EP ranks) and its own
    # expert-parallel stream ends where it should. Under PP every rank's step records the gradient
    # norm of the whole model, which the EP ranks > 0 already changed on the first resumed step.
    first = resume.RESUME_AT + 1
    assert off["verdict"] == "inexact"
    for r in off["ranks"]:
        if r["ep"] > 0:
            assert r["first_step"] == first, resume_fail_text(off)
            assert RNG_EXPERT in r["differ_all"], r["differ_all"]
        else:
            assert RNG_EXPERT not in r["differ_all"], r["differ_all"]
            assert (r["first_step"] == first) == (cfg.pp > 1), resume_fail_text(off)


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


def _assert_padding_past_the_unpadded_end_refused(off):
    """PP=2 x DP=2 with tied embeddings, every fix off: on the first stage the bucket before the word
    embedding is declared up to the embedding's 64-aligned start, and data-parallel rank 1 describes
    its padding on to the padded end; torch DCP rejects the plan on the coordinator, global rank 0
    (NVIDIA/Megatron-LM#5898)."""
    assert off["verdict"] == "error", resume_fail_text(off)
    head = "save run: rank 0: ValueError: Failed to validate global plan: key:optimizer.distributed.dp_group_idx_0."
    assert off["error"].startswith(head) and "out of bounds chunk" in off["error"], off["error"]
    assert "save_checkpoint" in off["detail"], off["detail"][-2000:]


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
    if cfg.name == "dense-dp2-new-wd-checkpoint-scheduler":
        _assert_first_step_with_the_new_weight_decay(cfg, out)
        return
    if cfg.name == "dense-dp2-strictness-return":
        _assert_returned_tuple_refused(cfg, out)
        return
    _assert_strictness_values_without_the_fixes(cfg, out)


def _assert_returned_tuple_refused(cfg, out):
    """--dist-ckpt-strictness return_unexpected / return_all, every fix off: dist_checkpointing.load
    returns (state dict, missing keys, unexpected keys) and load_checkpoint takes the tuple for the
    state dict: every rank stops there, under both values (fix strictness-return-keys)."""
    assert out["needed_here"] == ["strictness-return-keys"], out["needed_here"]
    for (option, value), way in each_way(cfg, out["off"]):
        assert option == "--dist-ckpt-strictness" and value.startswith("return_"), (option, value)
        assert way["verdict"] == "error", (value, resume_fail_text(way))
        assert way["errors"] == [[rank, RETURNED_TUPLE] for rank in range(cfg.world)], (value, way["errors"])
        assert "load_checkpoint" in way["detail"], way["detail"][-2000:]


def _assert_new_lr_refused_from_019(cfg, out):
    """A new --lr / --min-lr with --use-checkpoint-opt-param-scheduler, every fix off: 0.17 and 0.18
    match the saved param groups without their learning rates and go on with the checkpoint's schedule,
    exactly; 0.19 matches them by max_lr / min_lr and every rank stops in load_checkpoint (fix
    param-group-identity; catalogued as lr-change-resume-group-mismatch)."""
    ((args, way),) = each_way(cfg, out["off"])
    if megatron_version().release < (0, 19):
        assert way["verdict"] == "exact", resume_fail_text(way)
        assert out["needed_here"] == [], out["needed_here"]
        return
    assert out["needed_here"] == ["param-group-identity"], out["needed_here"]
    assert way["verdict"] == "error", resume_fail_text(way)
    assert way["errors"] == [[rank, NEW_LR_GROUPS] for rank in range(cfg.world)], way["errors"]
    assert "load_checkpoint" in way["detail"], way["detail"][-2000:]


def _assert_first_step_with_the_new_weight_decay(cfg, out):
    """A new --weight-decay with --use-checkpoint-opt_param-scheduler, every fix off: the scheduler's
    load steps the param groups with the new weight decay before it restores the checkpoint's, so the
    first resumed update decays with 0.05 (its loss, computed before the update, is exact; the next
    one differs), and the scheduler's next step writes the checkpoint's 0.01 again: at the end the
    groups and the scheduler agree with the uninterrupted run, the parameters and the optimizer's
    main values do not (fix scheduler-checkpoint-wd, NVIDIA/Megatron-LM#7468)."""
    ((args, way),) = each_way(cfg, out["off"])
    assert out["needed_here"] == ["scheduler-checkpoint-wd"], out["needed_here"]
    assert way["verdict"] == "inexact", resume_fail_text(way)
    for r in way["ranks"]:
        assert r["first_step"] == resume.RESUME_AT + 2, resume_fail_text(way)
        assert any(n.startswith("param:") for n in r["differ_all"]), r["differ_all"]
        assert not [n for n in r["differ_all"] if n.startswith("scheduler:") or n.endswith(":weight_decay")], r


def _assert_strictness_values_without_the_fixes(cfg, out):
    """Every --dist-ckpt-strictness value that hands load_checkpoint the loaded state, every fix off.
    On 0.18+ the release writes the rerun machine's idle entry and load_checkpoint leaves it out of
    its request: raise_all stops every rank on it (rerun-state-strict-load's bug), log_all only logs
    it, ignore_all does not look, and the *_unexpected values and the default do not compare the
    request with the whole checkpoint; each of those resumes exactly. 0.17 writes no idle entry:
    every value resumes exactly."""
    assert cfg.name == "dense-dp2-strictness-values", cfg.name
    for (option, value), way in each_way(cfg, out["off"]):
        assert option == "--dist-ckpt-strictness", option
        if value == "raise_all" and out["needed_here"] == ["rerun-state-strict-load"]:
            assert way["verdict"] == "error", resume_fail_text(way)
            assert way["errors"] == [[rank, STRICT_ALL_MISSING] for rank in range(cfg.world)], way["errors"]
            assert "load_checkpoint" in way["detail"], way["detail"][-2000:]
        else:
            assert way["verdict"] == "exact", (value, resume_fail_text(way))
    assert out["needed_here"] == ([] if megatron_version().release < (0, 18) else ["rerun-state-strict-load"])


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


# megatron.training's load_checkpoint takes dist_checkpointing.load's result as the state dict; with
# return_unexpected / return_all it is (state dict, missing keys, unexpected keys) (fix
# strictness-return-keys; catalogued as dist-ckpt-strictness-return-tuple).
RETURNED_TUPLE = "AttributeError: 'tuple' object has no attribute 'get'"
# 0.19 matches the saved param groups to the new ones by their max_lr / min_lr (catalogued:
# lr-change-resume-group-mismatch); 0.17 and 0.18 take the checkpoint's schedule, as the option says.
NEW_LR_GROUPS = "KeyError: (None, 0.02, 0.002, None, None, 1.0, 1.0, False, False)"


def assert_as_release_with_the_fixes(cfg, out):
    """With the fixes, each way of resuming is the release's own (run C without them) bit for bit on
    every rank: every resumed loss, parameter, optimizer tensor and scalar, the scheduler, every RNG
    stream and the iteration load_checkpoint returned. A dense DP=2 job: no fix is needed, so
    nothing here may change with them. (The --dist-ckpt-strictness values that return the keys,
    where the release stops, resume exactly with the fixes: dense-dp2-strictness-return.)"""
    assert out["needed_here"] == [], out["needed_here"]
    on = out["on"]
    assert on["verdict"] == resume.AS_RELEASE, resume_fail_text(on)
    for args, way in each_way(cfg, on):
        assert way["verdict"] == resume.AS_RELEASE, (args, resume_fail_text(way))
        assert way["same"] == "bits", (args, way)
        assert_every_rank_compared(cfg, way)


def assert_release_resumes_as_each_option_says(cfg, out):
    """The release's own resume (every fix off) against its uninterrupted run: each option reached
    the resumed run and did what it says, so that the comparison above compares resumes that differ
    from the uninterrupted one where they should. --no-load-optim: the model loads (step 3 exact),
    the optimizer and scheduler start afresh (step 4 and the moments differ); --no-load-rng: every
    stream starts from the seed (step 3 differs); --finetune: only the model loads, iteration 0;
    --use-checkpoint-opt-param-scheduler: exact, with the same schedule and, on 0.17 and 0.18, with a
    new --lr / --min-lr too (the checkpoint's wins)."""
    for args, way in each_way(cfg, out["off"]):
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
