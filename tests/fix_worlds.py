"""Both halves of a fix's round trips, one warm world each, for the fix tests' module fixtures.

The entry point's module names a ``prepare`` (run in the parent first, so the worlds fork warm); the
fix-off half runs with ``off_env`` (the fix's own flag off, or every fix off), the other with the
flags at their defaults. Outside the fix's declared range the module's tests skip.
"""

import pytest

from mcore_ckpt_fixes.testing import resolve
from mcore_ckpt_fixes.testing.launcher import run_world, values


def both_halves(
    fix, entry, off_env=None, tmp_path_factory=None, mcore_version=None, nproc=2, affected=True, kwargs=None
):
    """``{patched: [each rank's value]}`` for ``entry`` ("module:function") with the fix off and on.
    ``off_env``: the fix-off half's flags, the fix's own flag off by default. ``affected=False``: the
    releases outside the fix's range instead (where the release works, both halves alike).
    ``kwargs``: more arguments of ``entry``, the same in both halves."""
    from mcore_ckpt_fixes.engine.flags import env_var_for

    off_env = {env_var_for(fix.id): "off"} if off_env is None else off_env
    if not affected and mcore_version in fix.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is inside {fix.affected}")
    if affected and mcore_version not in fix.specifiers:
        pytest.skip(f"Megatron-Core {mcore_version} is outside {fix.affected}")
    resolve(f"{entry.partition(':')[0]}:prepare")()
    out = {}
    for patched in (False, True):
        ckpt = str(tmp_path_factory.mktemp(f"patched{patched}"))
        args = {"ckpt_dir": ckpt, "patched": patched, **(kwargs or {})}
        out[patched] = values(run_world(entry, nproc, args, env={} if patched else dict(off_env)))
    return out
