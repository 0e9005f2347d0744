"""strictness-return-keys in a job: the layer on ``megatron.training.checkpointing``'s
``_load_global_dist_base_checkpoint`` and the probe. Imported only when that module is; why: the
package's docstring, in full: doc.md.
"""

from __future__ import annotations

import inspect
import logging
import types

import torch

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import in_scope, module_scope
from .. import FUNCTION, ID, MODULE

# Named as Megatron's module names its own: the text below logs through ``logger`` in both places.
logger = logging.getLogger("mcore_ckpt_fixes")

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/training/checkpointing.py, above load_checkpoint (there ``logger`` is that module's own).

# The most keys of each kind one warning names (sorted); the others are counted.
_MISMATCH_KEYS_SHOWN = 8


def _state_dict_alone(loaded):
    """The state dict of what ``dist_checkpointing.load`` returned. With ``--dist-ckpt-strictness``
    return_unexpected or return_all it returns (state dict, missing keys, unexpected keys), so that
    the caller handles the mismatch; load_checkpoint has no use for the keys and expects the state
    dict alone. The keys are logged instead, on each rank that has any, at WARNING, as log_unexpected
    and log_all report them; the load goes on as with those values."""
    if not (isinstance(loaded, tuple) and len(loaded) == 3 and isinstance(loaded[0], dict)):
        return loaded
    state_dict, missing_keys, unexpected_keys = loaded
    found = [
        f"{len(keys)} {kind} {_some_keys(keys)}"
        for kind, keys in (
            ("missing (in the checkpoint, asked for by no rank):", missing_keys),
            ("unexpected (asked for by this rank, not in the checkpoint, not loaded):", unexpected_keys),
        )
        if keys
    ]
    if found:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        logger.warning(
            "rank %d: the load's request and the checkpoint do not match (--dist-ckpt-strictness "
            "return_unexpected / return_all: loaded as with log_unexpected / log_all): %s",
            rank,
            "; ".join(found),
        )
    return state_dict


def _some_keys(keys):
    shown = sorted(keys)[:_MISMATCH_KEYS_SHOWN]
    more = len(keys) - len(shown)
    return repr(shown) + (f" and {more} more" if more else "")


# -- end of replacement ---


@layer(ID, MODULE, FUNCTION)
def load_global_dist_base_checkpoint(
    below_us, load_dir, args, rank0, sharded_state_dict, iteration, release, checkpointing_context=None, **groups
):
    """The release's loader, handing on the state dict alone where ``dist_checkpointing.load``
    returned the mismatching keys with it (their warning: :func:`_state_dict_alone`). Whatever else
    it returns (any other strictness, the common state of ``rank0=True``) is passed on as it is.

    The release's parameters by name (``groups``: 0.19's ``dp_cp_group`` / ``expt_dp_group``, passed
    on as given): rng-under-ep's layer above binds them to find the request it aligns."""
    result = below_us(load_dir, args, rank0, sharded_state_dict, iteration, release, checkpointing_context, **groups)
    if not (isinstance(result, tuple) and result):
        return result
    state_dict = _state_dict_alone(result[0])
    return result if state_dict is result[0] else (state_dict, *result[1:])


# -- probe: the release's loader, dist_checkpointing.load stood in ------------------------------------

PROBE_DIR = "/nonexistent/mcore_ckpt_fixes_probe"


class ProbeArgs:
    """Megatron's arguments as the loader reads them: a strictness that returns the keys, no fully
    parallel load; every other option unset (None)."""

    dist_ckpt_strictness = "return_all"
    ckpt_fully_parallel_load = False

    def __getattr__(self, name):
        return None


class ProbeDistCheckpointing:
    """``dist_checkpointing`` as the loader calls it, reading nothing: ``load`` takes the release's
    own signature and returns as the release's does for the strictness it is given, the state dict
    alone or (state dict, no missing keys, no unexpected keys). Any other name is not stood in."""

    def __init__(self, real):
        from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

        self.signature = inspect.signature(original(real, "load"))
        self.returns_keys = lambda strict: StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict))
        self.state_dict = {}
        self.with_keys = (self.state_dict, set(), set())

    def load(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return self.with_keys if self.returns_keys(bound.arguments["strict"]) else self.state_dict

    def __getattr__(self, name):
        raise AttributeError(f"probe stand-in for dist_checkpointing has no {name}")


def handed_on(module: types.ModuleType):
    """(what the release's loader returns as the state dict, the stand-in) for a sharded load under
    return_all, in a copy of the module's globals with ``dist_checkpointing.load`` and the load
    strategy stood in: nothing is read, and the live module is left as it is."""
    stand_in = ProbeDistCheckpointing(module.__dict__["dist_checkpointing"])
    scope = module_scope(
        module,
        dist_checkpointing=stand_in,
        get_checkpoint_name=lambda *args, **kwargs: PROBE_DIR,
        TorchDistLoadShardedStrategy=lambda *args, **kwargs: None,
    )
    loader = in_scope(original(module, FUNCTION), scope)
    result = loader(
        load_dir=PROBE_DIR, args=ProbeArgs(), rank0=False, sharded_state_dict={}, iteration=1, release=False
    )
    return (result[0] if isinstance(result, tuple) and result else result), stand_in


def probe(module: types.ModuleType):
    if FUNCTION not in module.__dict__ or "dist_checkpointing" not in module.__dict__:
        return None, f"{MODULE} has no {FUNCTION} / dist_checkpointing"
    state, stand_in = handed_on(module)
    if state is stand_in.with_keys:
        return True, (
            f"{FUNCTION} hands on dist_checkpointing.load's (state dict, missing keys, unexpected keys) as the "
            "state dict under --dist-ckpt-strictness return_unexpected / return_all: load_checkpoint stops on it"
        )
    if state is stand_in.state_dict:
        return False, f"{FUNCTION} hands on the state dict alone under --dist-ckpt-strictness return_all"
    return None, f"{MODULE}.{FUNCTION} could not be judged: it returned {type(state).__name__} as the state dict"
