"""Fixtures of the doctor tests (imported by each test module; not a conftest.py, whose module name
would shadow tests/conftest.py): checkpoints saved once per session by this release's real save paths (see
ckpt_makers), and helpers to make damaged copies (the originals are never modified)."""

from __future__ import annotations

import os
import shutil

import pytest

from mcore_ckpt_fixes.testing.launcher import run_world, values


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """{name: checkpoint root}; torch_dist and DCP saved by 2-rank gloo worlds forked from here."""
    import megatron.core.dist_checkpointing  # noqa: F401  (warm parent: the worlds fork from it)
    import torch.distributed.checkpoint  # noqa: F401

    base = tmp_path_factory.mktemp("doctor-ckpts")
    roots = {name: str(base / name) for name in ("torch_dist", "fsdp", "fsdp_collide")}
    for name in roots.values():
        os.makedirs(name)
    values(run_world("ckpt_makers:save_torch_dist", 2, {"root": roots["torch_dist"]}, timeout=240))
    values(run_world("ckpt_makers:save_fsdp_dcp", 2, {"root": roots["fsdp"]}, timeout=240))
    values(
        run_world(
            "ckpt_makers:save_fsdp_dcp", 2, {"root": roots["fsdp_collide"], "local_bias_index": True}, timeout=240
        )
    )
    return roots


@pytest.fixture
def copy_of(tmp_path):
    """copy_of(root) -> a private copy to damage."""

    def _copy(root):
        dst = tmp_path / ("copy-" + os.path.basename(root))
        shutil.copytree(root, dst)
        return str(dst)

    return _copy


def iter_dir(root):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(root, "iter_{:07d}".format(int(f.read().strip())))
