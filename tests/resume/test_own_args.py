"""Reading a user's own job's arguments (mcore_ckpt_fixes.resume.own_args): one command line, an
argument file, or a launch script as users keep them, here Megatron-LM's own example scripts
(tests/resume/megatron_examples, verbatim from the release tags). Nothing here needs Megatron."""

from __future__ import annotations

import os

import pytest

from mcore_ckpt_fixes.resume.own_args import from_file, from_text, unresolved

pytestmark = pytest.mark.one_line  # plain Python: the same on every release line

EXAMPLES = os.path.join(os.path.dirname(__file__), "megatron_examples")


def _value(argv, option):
    return argv[argv.index(option) + 1]


@pytest.mark.parametrize("line", ["0.17", "0.19"])
def test_gpt3_script_arrays_and_positional_parameters(line):
    argv, script = from_file(os.path.join(EXAMPLES, line, "gpt3_175b.sh"))
    assert script == "pretrain_gpt.py"
    assert _value(argv, "--num-layers") == "96"
    assert _value(argv, "--tensor-model-parallel-size") == "8"
    assert _value(argv, "--pipeline-model-parallel-size") == "16"
    # $1 is the checkpoint path the user passes the script: not set here, kept as a marker.
    assert unresolved(_value(argv, "--save")) == "$1"
    assert "--nproc_per_node" not in argv  # torchrun's own arguments are not the job's


def test_mixtral_script_continuations_inside_arrays_and_defaults():
    argv, script = from_file(os.path.join(EXAMPLES, "0.19", "mixtral_8x7b.sh"))
    assert script == "pretrain_gpt.py"
    assert _value(argv, "--expert-model-parallel-size") == "8"
    assert _value(argv, "--num-experts") == "8"
    assert "--no-load-optim" in argv and "--moe-grouped-gemm" in argv
    assert unresolved(_value(argv, "--tensorboard-dir")) == "$1"  # "${CHECKPOINT_PATH}/tensorboard"


def test_variables_file_without_launch_line():
    argv, script = from_file(os.path.join(EXAMPLES, "0.19", "deepseek_v2_lite_modelopt_conf.sh"))
    assert script is None
    assert _value(argv, "--moe-layer-freq") == "([0]+[1]*26)"
    assert "--multi-latent-attention" in argv and argv[0] == "--save-interval"


def test_sbatch_heredoc_and_appended_arrays():
    """An sbatch script: the job's arguments in an array that ``if`` blocks extend with
    ``PRETRAIN_ARGS=( "${PRETRAIN_ARGS[@]}" ... )``; the blocks are read as if taken."""
    argv, _ = from_file(os.path.join(EXAMPLES, "0.19", "deepseek_v3_mfsdp.sh"))
    assert _value(argv, "--expert-model-parallel-size") == "8"  # ${EP:-8}
    assert "--use-megatron-fsdp" in argv  # appended by the Megatron-FSDP block
    assert argv.count("--num-layers") == 1  # appending does not repeat what was there


def test_argument_file_and_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_LAYERS", "12")
    path = tmp_path / "args.txt"
    path.write_text("# my job\n--num-layers $MY_LAYERS  # from the environment\n--hidden-size 64\n")
    argv, script = from_file(str(path))
    assert (argv, script) == (["--num-layers", "12", "--hidden-size", "64"], None)
    assert from_text("--lr 1e-4 --save ${CKPT:-/ckpt}") == ["--lr", "1e-4", "--save", "/ckpt"]
    assert unresolved(from_text("--load $NOT_SET_ANYWHERE")[1]) == "$NOT_SET_ANYWHERE"


def test_unbalanced_quote_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot split"):
        from_text("--lr '1e-4")
    with pytest.raises(ValueError, match="cannot read it"):
        from_file(str(tmp_path / "missing.sh"))
