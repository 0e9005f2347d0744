"""chained-optim-main-params-split's monkeypatch on ``megatron.core.optimizer.optimizer``: a wrapper
of ``ChainedOptimizer._split_state_dict`` (what ``ChainedOptimizer.reload_model_params`` splits the
checkpoint with), the probe. Why: the package's docstring. Imported only when the target
module is.

The wrapper asks :func:`_state_dicts_by_own_chunks` for each sub-optimizer's part and hands any call
it does not recognise (the helper's ``None``) to the release's own method.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from .. import ID, MODULE

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, above class ChainedOptimizer.


def _state_dicts_by_own_chunks(chained, state_dict):
    """Each sub-optimizer's part of ``state_dict`` for ChainedOptimizer.reload_model_params: the
    entries of its own model_chunks, found by identity among the chained optimizer's chunks and
    numbered from 0 as the sub-optimizer counts them (with one chunk, the whole state dict). Every
    sub-optimizer covering a chunk needs the checkpoint's values: dense and expert optimizers both
    cover every chunk, and one left without them rebuilds its fp32 main parameters from the bf16
    model parameters. None where the call is not of that shape (no state dict, a sub-optimizer
    without model_chunks, a chunk the chained optimizer does not hold, a chunk key missing): the
    caller then splits as before."""
    chunks = list(getattr(chained, "model_chunks", None) or ())
    subs = list(getattr(chained, "chained_optimizers", None) or ())
    if state_dict is None or not chunks or not subs or not isinstance(state_dict, dict):
        return None
    if not all(isinstance(getattr(sub, "model_chunks", None), (list, tuple)) for sub in subs):
        return None
    position = {id(chunk): i for i, chunk in enumerate(chunks)}
    if any(id(chunk) not in position for sub in subs for chunk in sub.model_chunks):
        return None
    if len(chunks) == 1:
        return [state_dict if sub.model_chunks else None for sub in subs]
    prefix = "model" if "model0" in state_dict else "model_"
    if any(f"{prefix}{i}" not in state_dict for i in range(len(chunks))):
        return None
    return [
        {f"{prefix}{j}": state_dict[f"{prefix}{position[id(chunk)]}"] for j, chunk in enumerate(sub.model_chunks)}
        or None
        for sub in subs
    ]


# -- end of replacement ---


@layer(ID, MODULE, "_split_state_dict", owner="ChainedOptimizer")
def split_state_dict(below_us, self, state_dict):
    """``ChainedOptimizer._split_state_dict``: each sub-optimizer gets the checkpoint's entries of
    its own model chunks; any other call, the release's split."""
    parts = _state_dicts_by_own_chunks(self, state_dict)
    if parts is not None:
        return parts
    return below_us(self, state_dict)


# -- probe: the release's own split on stand-in sub-optimizers (no model, no process group) --------


def _release_split(cls):
    fn = cls.__dict__["_split_state_dict"]
    return original(cls, "_split_state_dict") if is_replacement(fn) else fn


def _stand_in(cls, chunks, n_subs):
    """A ChainedOptimizer whose sub-optimizers each cover every chunk (the dense and expert
    optimizers of an MoE model): only the attributes _split_state_dict reads."""
    chained = object.__new__(cls)
    chained.model_chunks = list(chunks)
    chained.chained_optimizers = [types.SimpleNamespace(model_chunks=list(chunks)) for _ in range(n_subs)]
    return chained


def leaves_a_sub_optimizer_without_its_chunks(cls) -> bool:
    """With one chunk, does the second sub-optimizer get nothing; with two, does the release fail or
    give the second sub-optimizer other chunks than its own?"""
    split = _release_split(cls)
    one = object()
    if split(_stand_in(cls, [one], 2), {"model": "chunk0"})[1] is None:
        return True
    first, second = object(), object()
    try:
        parts = split(_stand_in(cls, [first, second], 2), {"model0": "chunk0", "model1": "chunk1"})
    except AssertionError:
        return True
    return parts[1] != {"model0": "chunk0", "model1": "chunk1"}


def probe(module: types.ModuleType):
    cls = module.__dict__.get("ChainedOptimizer")
    if cls is None or "_split_state_dict" not in cls.__dict__:
        return None, f"{MODULE}'s ChainedOptimizer reloads no main parameters from a state dict"
    if not leaves_a_sub_optimizer_without_its_chunks(cls):
        return False, "every sub-optimizer of a ChainedOptimizer gets the state dict of its own model chunks"
    return True, (
        "ChainedOptimizer.reload_model_params(state_dict) gives only the first sub-optimizer the checkpoint "
        "(one chunk) or hands chunks out by a running offset (several): the others keep the bf16 values"
    )
