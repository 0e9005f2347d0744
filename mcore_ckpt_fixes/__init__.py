"""mcore-ckpt-fixes: fixes for Megatron-Core distributed checkpointing, applied at import.

``import mcore_ckpt_fixes`` applies every enabled fix whose probe finds the bug in the Megatron-Core
this process runs, whether Megatron was imported before or after. It imports neither torch nor
megatron itself: fixes for modules not imported yet wait in post-import hooks.

Flags (read at import and by :func:`apply`): ``MCORE_CKPT_FIXES`` = auto | off | comma list of fix
ids; ``MCORE_CKPT_FIX_<ID>`` = auto | off | on | require.
"""

from __future__ import annotations

from .engine.errors import FixRequiredError, FlagError, MegatronPatchWarning
from .engine.registry import ENGINE as _ENGINE

__version__ = "0.1.0"
__all__ = [
    "apply",
    "revert",
    "report",
    "MegatronPatchWarning",
    "FlagError",
    "FixRequiredError",
    "__version__",
]


def apply(environ=None) -> None:
    """(Re)read the flags and apply every enabled fix; safe to call any number of times."""
    _ENGINE.apply(environ)


def revert(fix_ids=None) -> None:
    """Restore the exact original Megatron objects (all fixes, or the ids given)."""
    _ENGINE.revert(fix_ids)


def report() -> list:
    """One dict per registered fix: ``id``, ``state``, ``reason`` and details (see ``status``)."""
    return _ENGINE.report()


def _launched_as_cli() -> bool:
    # ``python -m mcore_ckpt_fixes`` (argv[0] is "-m" while the package imports) or the console script.
    import os
    import sys

    return bool(sys.argv) and (sys.argv[0] == "-m" or os.path.basename(sys.argv[0]) == "mcore-ckpt-fixes")


try:
    apply()
except FlagError as _exc:
    if not _launched_as_cli():
        raise
    import sys as _sys

    _sys.stderr.write(f"mcore-ckpt-fixes: {_exc}\n")
    raise SystemExit(2) from None
