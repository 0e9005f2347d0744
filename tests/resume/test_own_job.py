"""The resume check on a user's own job (``selftest --resume --megatron-args``), with Megatron-LM's
own example argument sets from the release tags (tests/resume/megatron_examples): the release
parses and validates them, the model is shrunk and everything else kept; trained, saved, stopped
and resumed in new processes, each must be exact with the fixes (or, for a job that does not load
its optimizer or RNG state, the release's own resume bit for bit), and unchanged by them where it
never resumes.

The runs (five worlds each) are on the two lines the check is documented for, 0.19 and 0.17; the
plans (the release's parser only) on every line with ``megatron.training``. On CPU the examples'
Transformer Engine, grouped GEMM and, where the release's local attention has no MLA path,
multi-latent attention cannot be kept (``--allow-drop``); a layout larger than 4 ranks is reduced.
"""

from __future__ import annotations

import os

import pytest
from conftest import needs_megatron_training, on_this_line, resume_fail_text

EXAMPLES = os.path.join(os.path.dirname(__file__), "megatron_examples")
# Neither tag's GPT-3 script is accepted by its own release (test_release_refuses_its_gpt3_script):
# 0.17.1 refuses --rampup-batch-size with --train-iters, 0.19 its --step-batch-size-schedule with
# --global-batch-size. The dense TP x PP job is the script without that option, as its user must run it.
GPT3_REFUSED = {"0.17": "--rampup-batch-size", "0.19": "--step-batch-size-schedule"}
# The DeepSeek modelopt file holds the model's arguments only: a user adds the run's own.
DEEPSEEK_RUN = (
    "--expert-model-parallel-size 2 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --use-distributed-optimizer"
)


@pytest.fixture(autouse=True)
def _megatron_training():
    needs_megatron_training()


def _line_dir():
    from conftest import megatron_version

    version = megatron_version()
    return os.path.join(EXAMPLES, "0.17" if version.release[:2] <= (0, 18) else "0.19")


def _argv(path, extra="", without=None):
    from mcore_ckpt_fixes.resume.own_args import from_file, from_text
    from mcore_ckpt_fixes.resume.own_shrink import groups, option_table, parser

    argv, _ = from_file(path)
    if without:  # the option and the words it takes, as the release's parser reads them
        argv = [
            w
            for option, _, values in groups(argv, option_table(parser()))
            if option != without
            for w in [option, *values]
        ]
    return argv + from_text(extra)


def _plan(path, extra="", nproc=4, without=None):
    from mcore_ckpt_fixes.resume.own_shrink import plan

    return plan(_argv(path, extra, without), nproc=nproc, device="cpu")


def _gpt3_plan():
    line = os.path.basename(_line_dir())
    return _plan(os.path.join(_line_dir(), "gpt3_175b.sh"), without=GPT3_REFUSED[line])


def _changed(plan):
    return {c.option: (c.after, c.kind) for c in plan.changes}


# -- the plan: the release's own parser, the model shrunk, the rest kept -------------------------------


def test_gpt3_plan_shrinks_the_model_and_names_what_this_host_cannot_keep():
    plan = _gpt3_plan()
    changed = _changed(plan)
    assert changed["--tensor-model-parallel-size"] == ("2", "dropped")  # TP 8 x PP 16: 128 ranks
    assert changed["--pipeline-model-parallel-size"] == ("2", "dropped")
    assert changed["--transformer-impl"] == ("local", "dropped")
    assert changed["--num-layers"] == ("2", "shrunk")  # one per pipeline stage
    assert changed["--initial-loss-scale"][1] == "shrunk"  # fp16: the first steps must update
    assert plan.world == 4 and plan.args.tensor_model_parallel_size == 2 and plan.args.fp16
    # Kept as the job has them.
    for option, value in (("--lr", "6.0e-5"), ("--lr-decay-style", "cosine"), ("--adam-beta2", "0.95")):
        assert plan.argv[plan.argv.index(option) + 1] == value
    assert "--fp16" in plan.argv and "--data-path" not in plan.argv


def test_mixtral_plan_keeps_moe_routing_and_needs_the_release_resume():
    from mcore_ckpt_fixes.resume.own_job import config_for

    plan = _plan(os.path.join(_line_dir(), "mixtral_8x7b.sh"))
    a = plan.args
    assert (a.pipeline_model_parallel_size, a.expert_model_parallel_size, plan.world) == (2, 2, 4)
    assert a.num_experts % 2 == 0 and a.num_experts >= a.moe_router_topk == 2
    assert a.moe_token_dispatcher_type == "alltoall" and a.moe_aux_loss_coeff == 1e-2
    assert _changed(plan)["--moe-grouped-gemm"] == ("off", "dropped")
    assert config_for(plan).expect == "as-release"  # --no-load-optim --no-load-rng


def test_deepseek_plan_samples_the_moe_layer_pattern():
    plan = _plan(os.path.join(_line_dir(), "deepseek_v2_lite_modelopt_conf.sh"), DEEPSEEK_RUN)
    assert _changed(plan)["--moe-layer-freq"] == ("[0,1]", "shrunk")  # first layer dense, then MoE
    assert plan.args.num_experts % 2 == 0 and plan.args.num_experts >= plan.args.moe_router_topk == 6
    assert plan.args.moe_router_score_function == "softmax" and plan.args.moe_router_pre_softmax


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--no-such-option 1", "parser refuses them: .*unrecognized arguments: --no-such-option"),
        ("--global-batch-size 0", "validate_args refuses them: AssertionError at `assert args.global_batch_size > 0`"),
    ],
)
def test_what_the_release_refuses(extra, message):
    from mcore_ckpt_fixes.resume.own_shrink import plan

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 "
    with pytest.raises(ValueError, match=message):
        plan(_argv(os.devnull, base + extra), device="cpu")


def test_release_refuses_its_gpt3_script():
    from conftest import megatron_version

    line = os.path.basename(_line_dir())
    if f"{megatron_version().release[0]}.{megatron_version().release[1]}" != line:
        pytest.skip(f"the scripts kept are the 0.17 and 0.19 tags'; this line reads {line}'s")
    with pytest.raises(ValueError, match="refuses them: .*(rampup|step-batch-size-schedule)"):
        _plan(os.path.join(_line_dir(), "gpt3_175b.sh"))
    assert GPT3_REFUSED[line] in _argv(os.path.join(_line_dir(), "gpt3_175b.sh"))


def test_megatron_fsdp_job_is_named_not_checked():
    with pytest.raises(ValueError, match="--use-megatron-fsdp: Megatron-FSDP"):
        _plan(os.path.join(_line_dir(), "deepseek_v3_mfsdp.sh"))


def test_nproc_must_fit_the_layout():
    with pytest.raises(ValueError, match="--nproc 3 does not fit .*multiple of 2"):
        _plan(
            os.devnull,
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --tensor-model-parallel-size 2 "
            "--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1",
            3,
        )


def test_bare_assert_is_named_by_its_line():
    with pytest.raises(ValueError, match="validate_args refuses them: AssertionError at `assert"):
        _plan(os.devnull, "--num-layers 2 --hidden-size 64 --num-attention-heads 4")  # no sequence length


# -- the runs: exact with the fixes, on 0.19 and 0.17 ------------------------------------------------

RUNS_ON = {name: ((0, 17),) for name in ("gpt3", "mixtral", "deepseek")}


def _run(name, plan, attribution=False):
    if not on_this_line(name, RUNS_ON):
        pytest.skip("runs on the 0.19 and 0.17 lines (CI's time; the plan tests run here)")
    from mcore_ckpt_fixes.resume import check
    from mcore_ckpt_fixes.resume.own_job import config_for, run_local

    check.prepare_core()
    report = run_local(config_for(plan()), attribution=attribution, progress=lambda *a: None)
    assert report["unchanged"]["verdict"] == "exact", resume_fail_text(report["unchanged"])
    return report


def test_gpt3_tp_pp_fp16_resumes_exactly():
    report = _run("gpt3", _gpt3_plan)
    assert report["verdict"] == "exact", resume_fail_text(report["exact"])


def test_mixtral_ep_pp_resumes_as_the_release():
    """The script loads neither optimizer nor RNG state: not meant to equal the uninterrupted run
    (without the fixes it does not), and with the fixes the release's own resume, bit for bit."""
    report = _run("mixtral", lambda: _plan(os.path.join(_line_dir(), "mixtral_8x7b.sh")))
    assert report["verdict"] == "as-release", resume_fail_text(report["as_release"])
    assert report["exact_off"]["verdict"] == "inexact"


def test_deepseek_moe_ep_needs_rng_under_ep():
    """EP=2 on a release rng-under-ep applies to: inexact without the fixes, exact with them; on
    0.19 the attribution names that fix alone."""
    from conftest import megatron_version

    newest = megatron_version().release >= (0, 19)
    conf = os.path.join(_line_dir(), "deepseek_v2_lite_modelopt_conf.sh")
    report = _run("deepseek", lambda: _plan(conf, DEEPSEEK_RUN), newest)
    assert report["verdict"] == "exact", resume_fail_text(report["exact"])
    assert report["exact_off"]["verdict"] == "inexact"
    assert report["fixes_change"] == "exact only with the fixes"
    if newest:
        assert report["explained_by"] == ["rng-under-ep"]
