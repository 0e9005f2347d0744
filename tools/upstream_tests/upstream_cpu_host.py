"""What upstream's unit tests need of a CPU host beside ``mcore_ckpt_fixes.testing``'s shims, for
tools/upstream_tests.py's ranks: installed by its pytest plugin, in those processes only."""

from __future__ import annotations

import torch


class _Inert:
    """What a stand-in module hands out for any name: a class to derive from, call, index or read
    attributes of, that does nothing (see ``stand_in_modules``)."""

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __class_getitem__(cls, item):
        return cls


def _inert_attribute(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert


def stand_in_modules(names) -> None:
    """Inert modules for third-party packages this environment lacks that only the import of
    Megatron-LM's training package needs (``UPSTREAM_TESTS_STANDINS``; on 0.16: its tokenizers'
    ``six`` and ``regex``, its RL package's ``pydantic``); no checkpoint test calls into them."""
    import importlib.util
    import sys
    import types

    for name in filter(None, names.split(",")):
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            module = types.ModuleType(name, "inert stand-in (tools/upstream_tests)")
            module.__getattr__ = _inert_attribute
            sys.modules[name] = module


def install_cuda_stream() -> None:
    """``torch.cuda.Stream()`` on the CPU (``megatron.training.get_model`` makes one for DDP): the
    CPU shims' stream, which waits for nothing (CPU work is ordered already)."""
    from mcore_ckpt_fixes.testing._cpu_shims import NoStream

    torch.cuda.Stream = lambda *args, **kwargs: NoStream()


def te_version_without_te() -> None:
    """Without Transformer Engine, 0.16's ``get_te_version()`` answers None and its
    ``is_te_min_version`` raises TypeError, which upstream's conftest (every test) and test modules
    call unguarded; 0.17+ answer ``Version("0.0.0")`` (no TE feature). Here 0.16 answers the same."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from packaging.version import Version

    from megatron.core import utils

    if utils.get_te_version() is None:
        utils._te_version = Version("0.0.0")
