"""Importing a framework under test (Megatron-Bridge, verl, ms-swift, ...), each run with the
framework really installed: ``tools/test.sh fw-<name>`` builds its environment from
``tools/frameworks/<name>.txt`` and runs this directory with ``MCORE_CKPT_FIXES_FRAMEWORK=<name>``.

Elsewhere (the release lines) a framework that is not installed skips its tests. In the framework's
own line it must import: there a failing import fails the tests instead of skipping them, so a
broken environment can never pass as skipped.
"""

from __future__ import annotations

import importlib
import os

import pytest


def import_framework(name: str, module: str):
    """Import ``module`` of framework ``name`` (its PyPI distribution name), or skip where that
    framework's line is not the one running; fail in its own line."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or whatever the framework's import chain raises
        if os.environ.get("MCORE_CKPT_FIXES_FRAMEWORK") == name:
            pytest.fail(f"{name} is this line's framework but {module} does not import: {type(exc).__name__}: {exc}")
        pytest.skip(f"{name} not installed here ({module}: {type(exc).__name__}); run tools/test.sh fw-{name}")
