"""``selftest --resume --megatron-args`` on the command line: bad input is one line and exit 2;
``--print-launch`` writes the shrunk job and the launcher's commands; ``--compare`` judges the runs
those commands wrote (here written by the same rank code in forked worlds: the launcher itself,
torchrun or srun, is the user's); the whole check end to end in one process, with ``--json``."""

from __future__ import annotations

import json
import os

import pytest
from conftest import needs_megatron_training, on_this_line

from mcore_ckpt_fixes.__main__ import main

SMALL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 4 --bf16 --lr 1e-4 --transformer-impl local "
    "--tensor-model-parallel-size 2 --use-distributed-optimizer"
)


def _one_line_error(capsys, argv, expected):
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mcore-ckpt-fixes")]
    assert code == 2 and len(err) == 1 and expected in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["selftest", "--megatron-args", "--lr 1"], "go with --resume"),
        (["selftest", "--resume", "--allow-drop"], "need the job's arguments"),
        (["selftest", "--resume", "--compare", "d", "--megatron-args", "--lr 1"], "give it alone"),
        (["selftest", "--resume", "--config", "dense-tp2", "--megatron-args", "--lr 1"], "--config names"),
    ],
)
def test_usage(capsys, argv, expected):
    _one_line_error(capsys, argv, expected)


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("--no-such-option 3", "unrecognized arguments: --no-such-option"),
        ("--global-batch-size 0", "validate_args refuses them"),
        ("--transformer-impl transformer_engine", "cannot keep on this host: --transformer-impl"),
    ],
)
def test_bad_job(capsys, extra, expected):
    needs_megatron_training()
    _one_line_error(capsys, ["selftest", "--resume", "--megatron-args", f"{SMALL} {extra}"], expected)


def test_world_that_cannot_run(capsys):
    needs_megatron_training()
    _one_line_error(
        capsys, ["selftest", "--resume", "--nproc", "3", "--megatron-args", SMALL], "--nproc 3 does not fit"
    )


def test_compare_without_a_plan(capsys, tmp_path):
    needs_megatron_training()
    _one_line_error(capsys, ["selftest", "--resume", "--compare", str(tmp_path)], "no plan.json there")


def _print_launch(capsys, directory):
    code = main(["selftest", "--resume", "--megatron-args", SMALL, "--print-launch", str(directory)])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_print_launch(capsys, tmp_path):
    """The layout is the job's own (no host limit: it runs on the user's cluster), kernels kept."""
    needs_megatron_training()
    out = _print_launch(capsys, tmp_path)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["world"] == 2 and "--transformer-impl" in saved["argv"]
    commands = [line for line in out.splitlines() if not line.startswith("#")]
    assert sum("torchrun" in c and "mcore_ckpt_fixes.resume.own_rank" in c for c in commands) == 5
    assert sum(c.startswith("srun ") for c in commands) == 5
    assert commands[-1] == f"mcore-ckpt-fixes selftest --resume --compare {tmp_path}"


def test_launched_runs_then_compare(capsys, tmp_path):
    """The five runs --print-launch prints, each a world of the rank code its commands start
    (own_rank.write_result, with the mode's fix flags), then --compare: exact with the fixes."""
    needs_megatron_training()
    if not on_this_line("own-job-compare", {}):
        pytest.skip("one line runs it (CI's time)")
    from mcore_ckpt_fixes.resume import check
    from mcore_ckpt_fixes.testing.launcher import run_world

    _print_launch(capsys, tmp_path)
    check.prepare_core()
    for phase, mode in (("uninterrupted", "off"), ("save", "on"), ("resume", "on"), ("save", "off"), ("resume", "off")):
        flags = {"MCORE_CKPT_FIXES": "off" if mode == "off" else "auto"}
        results = run_world(
            "mcore_ckpt_fixes.resume.own_rank:write_result",
            2,
            {"directory": str(tmp_path), "phase": phase, "mode": mode},
            env=flags,
            timeout=240,
        )
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    code = main(["selftest", "--resume", "--compare", str(tmp_path), "--json"])
    report = json.loads(capsys.readouterr().out)["report"]
    assert code == 0 and report["verdict"] == "exact" and report["unchanged"]["verdict"] == "exact", report
    assert os.path.isdir(tmp_path / "checkpoint-on" / "iter_0000003")


def test_a_launched_rank_takes_its_mode_not_the_shell_flags():
    """``python -m ...own_rank`` imports the package (and reads the shell's flags) before its own
    code runs: each rank then sets its mode's flags and applies them again."""
    from conftest import run_py

    code = """
import json, os
import mcore_ckpt_fixes
from mcore_ckpt_fixes.resume.own_rank import use_mode
states = lambda: sorted({row["state"] for row in mcore_ckpt_fixes.report()})
before = states()
use_mode("on")
on = states()
use_mode("off")
print(json.dumps([before, on, states(), [k for k in os.environ if k.startswith("MCORE_CKPT_FIX_")]]))
"""
    out = run_py(code, env={"MCORE_CKPT_FIXES": "off", "MCORE_CKPT_FIX_RNG_UNDER_EP": "off"})
    assert out.returncode == 0, out.stderr
    before, on, off, left = json.loads(out.stdout.strip().splitlines()[-1])
    assert before == ["disabled"] and "disabled" not in on and off == ["disabled"] and left == []
