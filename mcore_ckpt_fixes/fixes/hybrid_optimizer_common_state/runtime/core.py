"""hybrid-optimizer-common-state's monkeypatch on ``megatron.core.dist_checkpointing.strategies.common``:
the release's common-state load, run with the optimizer classes Megatron-Core puts in a hybrid
optimizer's param groups allowed; the probe and apply. Why: the package's docstring. Imported only
when the target module is.

0.17.0 on: a module function ``load_common`` (``serialization`` binds it by name); 0.15-0.16: the
method ``TorchCommonLoadStrategy.load_common``.
"""

from __future__ import annotations

import os
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import with_globals
from .. import ID, MODULE

STRATEGY = "TorchCommonLoadStrategy"


# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/dist_checkpointing/strategies/common.py, above the common-state load.


def _hybrid_optimizer_classes():
    """The optimizer classes a HybridDeviceOptimizer (--optimizer-cpu-offload) keeps in its param
    groups, which a fully_reshardable save puts into common.pt: the ones megatron.core.optimizer
    builds it from (TE's or Apex's FusedAdam where installed) and torch's own."""
    import sys

    import torch

    found = [torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]
    module = sys.modules.get("megatron.core.optimizer")
    for name in ("Adam", "SGD", "CPUAdam", "CPUSGD"):
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls not in found:
            found.append(cls)
    return found


def _allowing_optimizer_classes(load, *args, **kwargs):
    """``load(*args, **kwargs)`` (a torch.load) with those classes allowed: since torch 2.6 torch.load
    is weights_only by default and refuses any class it was not told about."""
    import torch

    with torch.serialization.safe_globals(_hybrid_optimizer_classes()):
        return load(*args, **kwargs)


# -- end of replacement ---


@layer(ID, MODULE, "load_common")
def load_common(below_us, checkpoint_dir):
    """``load_common`` (0.17.0 on), with the hybrid optimizer's classes allowed."""
    return _allowing_optimizer_classes(below_us, checkpoint_dir)


@layer(ID, MODULE, "load_common", owner=STRATEGY)
def strategy_load_common(below_us, self, checkpoint_dir):
    """``TorchCommonLoadStrategy.load_common`` (0.15-0.16), with the hybrid optimizer's classes allowed."""
    return _allowing_optimizer_classes(below_us, self, checkpoint_dir)


def _strategy(module):
    """The class whose ``load_common`` method is the load (0.15-0.16), or None (0.17.0 on)."""
    cls = module.__dict__.get(STRATEGY)
    return cls if cls is not None and "load_common" in cls.__dict__ else None


def _release_load(module):
    """The release's own common-state load as ``(function, takes_self)``, or None."""
    cls = _strategy(module)
    if cls is not None:
        return original(cls, "load_common"), True
    if callable(module.__dict__.get("load_common")):
        return original(module, "load_common"), False
    return None


class _InMemoryTorch:
    """torch, but ``torch.load(path, ...)`` reads ``data`` from memory with the arguments the
    release passes: the probe sees what torch makes of the release's own call, and writes no file."""

    def __init__(self, torch, data):
        self._torch, self._data = torch, data

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def load(self, path, *args, **kwargs):
        import io

        return self._torch.load(io.BytesIO(self._data), *args, **kwargs)


def _read_in_memory(fn, takes_self, data):
    """Run a copy of the release's ``fn`` whose globals name an in-memory torch (its own module's
    globals are left as they are): the release's call, torch's real ``weights_only`` rules."""
    import logging

    import torch

    stand_in = _InMemoryTorch(torch, data)
    quiet = logging.getLogger("mcore_ckpt_fixes.probe.silent")  # 0.19 warns that load_common is deprecated
    quiet.disabled = True
    # 0.19 reads through maybe_msc.torch.
    copy = with_globals(fn, torch=stand_in, logger=quiet, maybe_msc=types.SimpleNamespace(torch=stand_in))
    path = os.path.join(os.sep, "mcore-ckpt-fixes-probe-reads-nothing")
    return copy(object(), path) if takes_self else copy(path)


def probe(module: types.ModuleType):
    import io
    import pickle

    import torch

    release = _release_load(module)
    if release is None:
        return None, f"{MODULE} has no common-state load"
    if not hasattr(torch.serialization, "safe_globals"):
        return False, "torch has no weights_only allow-list (torch < 2.5): common.pt loads whole"
    # What a hybrid optimizer's fully_reshardable save writes there (its param groups, their classes).
    state = {"optimizer": {"optimizer": {"param_groups": [{"lr": 0.1, "cpu_optimizer_cls": torch.optim.AdamW}]}}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    try:
        _read_in_memory(*release, buffer.getvalue())
    except pickle.UnpicklingError:
        return True, "the common-state load refuses the optimizer classes in a hybrid optimizer's param groups"
    return False, "the common-state load reads a hybrid optimizer's param groups"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    cls = _strategy(module)
    if cls is not None:
        patcher.replace(cls, "load_common", strategy_load_common)
    else:
        patcher.replace_function(module, "load_common", load_common)
