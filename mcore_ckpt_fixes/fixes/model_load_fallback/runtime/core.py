"""model-load-fallback in a job: the layers and the probe. Imported only once
``megatron.training.checkpointing`` is; why: the package's docstring, in full: doc.md.

``load_checkpoint`` retries a model load that failed strict with ``strict=False``, inside a helper
nested in it (``load_model_state_dict``), which no monkeypatch can reach. And the wrappers between
it and the model (Megatron's DDP, ``Float16Module``, Megatron-FSDP) drop what torch's
``load_state_dict`` returns, so only the model's own ``load_state_dict`` (torch's, which every
Megatron model inherits through ``MegatronModule``) sees which weights the retry left out. Hence two
layers: ``load_checkpoint`` marks its call in a context variable, and ``MegatronModule.load_state_dict``
notes, within such a call, a strict load that failed and judges the non-strict retry of the same
model that follows it. Outside ``load_checkpoint`` (any other caller, any other strictness) it is
the release's call and nothing else.
"""

from __future__ import annotations

import contextvars
import logging
import types

import torch

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import module_scope
from .. import FUNCTION, ID, MODULE, NESTED

# Named as Megatron's module names its own: the replacement text logs through ``logger`` in both places.
logger = logging.getLogger("mcore_ckpt_fixes")
MODELS = "megatron.core.transformer.module"


def get_args():
    """megatron.training's arguments, as the replacement text below reads them where the source diff
    puts it (that module's own ``get_args``). Imported on use: the engine resolves every fix's probe
    on releases whose wheel has no megatron.training."""
    from megatron.training.global_vars import get_args as training_args

    return training_args()


# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/training/checkpointing.py, above load_checkpoint (there ``logger`` is that module's own).

# The --dist-ckpt-strictness values that load without the keys the checkpoint lacks: the user chose
# to go on without them.
_STRICTNESS_DROPPING_MISSING = ("log_all", "ignore_all", "return_all")
# The most weights one message names (sorted); the others are counted.
_DROPPED_WEIGHTS_SHOWN = 8


def _dropped_model_weights(missing_keys, unexpected_keys):
    """After load_checkpoint's non-strict retry of a model load that failed strict: refuse the load
    where it left model weights at their initial values (``missing_keys`` other than Transformer
    Engine's ``_extra_state``, whose absence the retry exists for), unless the run's
    --dist-ckpt-strictness drops the checkpoint's missing keys by choice; then they are named in
    one warning on this rank. Unexpected keys alone, or missing extra state alone: as before."""
    dropped = sorted(key for key in missing_keys if not key.endswith("_extra_state"))
    if not dropped:
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    shown = dropped[:_DROPPED_WEIGHTS_SHOWN]
    more = len(dropped) - len(shown)
    names = repr(shown) + (f" and {more} more" if more else "")
    strictness = getattr(get_args(), "dist_ckpt_strictness", None)
    if strictness in _STRICTNESS_DROPPING_MISSING:
        logger.warning(
            "rank %d: the checkpoint lacks %d of this model's weights, which keep their initial values "
            "(--dist-ckpt-strictness %s): %s",
            rank,
            len(dropped),
            strictness,
            names,
        )
        return
    raise RuntimeError(
        f"rank {rank}: the checkpoint lacks {len(dropped)} of this model's weights ({names}; "
        f"{len(unexpected_keys)} keys of the checkpoint unused): load_checkpoint would train on with them at "
        "their initial values. Accepted: a checkpoint that has them, or --dist-ckpt-strictness log_all / "
        "ignore_all to go on without them (named in a warning)"
    )


# -- end of replacement ---

# Within a load_checkpoint call: the ids of the models whose strict load failed in it.
_STRICT_FAILED = contextvars.ContextVar("mcore_ckpt_fixes.model_load_fallback", default=None)


@layer(ID, MODULE, FUNCTION)
def load_checkpoint(below_us, *args, **kwargs):
    """The release's ``load_checkpoint``, its model loads judged by :func:`model_load_state_dict`."""
    token = _STRICT_FAILED.set(set())
    try:
        return below_us(*args, **kwargs)
    finally:
        _STRICT_FAILED.reset(token)


@layer(ID, MODELS, "load_state_dict", owner="MegatronModule")
def model_load_state_dict(below_us, self, state_dict, strict=True, *args, **kwargs):
    """torch's ``load_state_dict`` of a Megatron model. Inside ``load_checkpoint``: a strict load
    that fails is noted, and the non-strict retry of that model that follows is judged by what torch
    returns (:func:`_dropped_model_weights`)."""
    failed = _STRICT_FAILED.get()
    if failed is None:
        return below_us(self, state_dict, strict, *args, **kwargs)
    if strict:
        try:
            return below_us(self, state_dict, strict, *args, **kwargs)
        except Exception:
            failed.add(id(self))
            raise
    result = below_us(self, state_dict, strict, *args, **kwargs)
    if id(self) in failed:
        failed.discard(id(self))
        _dropped_model_weights(result.missing_keys, result.unexpected_keys)
    return result


def apply(module: types.ModuleType, patcher) -> None:
    import importlib

    patcher.replace_function(module, FUNCTION, load_checkpoint)
    patcher.replace(importlib.import_module(MODELS).MegatronModule, "load_state_dict", model_load_state_dict)


# -- probe: the release's nested helper, on a stand-in model --------------------------------------


class ProbeArgs:
    """Megatron's arguments as a patched helper reads them: no strictness that drops keys."""

    dist_ckpt_strictness = "assume_ok_unexpected"


def nested_helper(module: types.ModuleType):
    """The release's ``load_model_state_dict`` (nested in ``load_checkpoint``) as a function of a
    copy of the module's globals, ``print`` silenced and the arguments stood in; None where there is
    none to run on its own."""
    for const in original(module, FUNCTION).__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == NESTED:
            if const.co_freevars:
                return None  # it reads load_checkpoint's locals: not callable alone
            scope = module_scope(module, print=lambda *args, **kwargs: None, get_args=ProbeArgs)
            return types.FunctionType(const, scope, NESTED)
    return None


def probe(module: types.ModuleType):
    if FUNCTION not in module.__dict__:
        return None, f"{MODULE} has no {FUNCTION}"
    helper = nested_helper(module)
    if helper is None:
        return None, f"{MODULE}.{FUNCTION} has no {NESTED} helper this probe can run alone"
    model = torch.nn.Linear(1, 1, bias=False)  # a strict load of nothing misses its weight
    try:
        helper(model, {}, True)
    except RuntimeError:
        return False, f"{FUNCTION} refuses a model load that leaves a weight out"
    return True, (
        f"{FUNCTION} retries a model load that failed strict with strict=False and goes on without the "
        "missing weights, which keep their initial values, silently"
    )
