"""The launcher's parser speed-up (mcore_ckpt_fixes/testing/_arg_docs.py): a forked rank builds
``megatron.training``'s argument parser with exactly the help texts the release's own reader gives,
from what the world's parent read once; the parent's own Megatron is left as it is."""

import argparse

from conftest import needs_megatron_training

from mcore_ckpt_fixes.testing import _arg_docs
from mcore_ckpt_fixes.testing.launcher import run_world, values


def test_a_forked_rank_builds_the_releases_parser_from_what_the_parent_read():
    needs_megatron_training()
    from megatron.training.argument_utils import ArgumentGroupFactory
    from megatron.training.arguments import add_megatron_arguments

    release_reader = ArgumentGroupFactory._get_field_docstrings
    (rank,) = values(run_world("world_scenarios:argument_helps", 1, timeout=120))
    assert rank["looked_up"], "the rank read the config classes' sources itself"
    # What the release's own reader gives, here in the parent, where nothing was replaced.
    assert ArgumentGroupFactory._get_field_docstrings is release_reader
    own = {a.dest: a.help for a in add_megatron_arguments(argparse.ArgumentParser())._actions}
    assert rank["helps"] == own
    assert sum(1 for h in own.values() if h) > 100, "too few help texts to tell anything apart"
    read = _arg_docs.HELP_TEXTS
    assert read and all(
        read[cls] == release_reader(ArgumentGroupFactory.__new__(ArgumentGroupFactory), cls) for cls in read
    )
