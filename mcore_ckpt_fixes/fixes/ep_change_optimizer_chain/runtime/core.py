"""ep-change-optimizer-chain in a job: the layer on ``ChainedOptimizer.load_state_dict`` and the
probe. Why: the package's docstring, in full: doc.md.

Under expert parallelism Megatron builds one distributed optimizer for the dense parameters and one
for the expert parameters; without it, one for all. A ``fully_reshardable`` checkpoint keys every
tensor of the optimizer's state by its parameter, so the tensors load under either layout; but the
rest of each optimizer's state (its parameter groups with their ``step``, the sharding type) is the
common state, which the load hands back in the shape the *saving* job's chain had, merged with the
tensors in the shape the *loading* job's chain asked for. The release's load then meets a dict of
both shapes: ``KeyError: 'optimizer'`` (one optimizer now) or ``Expected 2 entries`` (two now).

Here such a mixed dict is put into the loading chain's shape before the release reads it: each
optimizer of the chain gets the tensors it asked for and the saved common state, with the saved
parameter groups of its own kind (dense or expert), or where the saving job had no such groups,
the other kind's groups with the same overrides. Any other state dict goes to the release untouched.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import CLASS, FUNCTION, ID, MODULE

_log = logging.getLogger("mcore_ckpt_fixes")

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/optimizer.py, above class ChainedOptimizer.


# The parameter-group key that tells expert groups from dense ones, and the group entries that are
# state, not identity (never used to pair a saved group with a current one).
_EXPERT_FLAG = "is_expert_parallel"
_NOT_GROUP_IDENTITY = ("params", "step", "lr", "weight_decay", _EXPERT_FLAG)


def _optimizer_state_in_chain_shape(chain, state_dict):
    """``state_dict`` as the optimizers of ``chain`` (a ChainedOptimizer) read it, where the load
    mixed two chains' shapes: the common state comes back in the shape of the chain that saved it
    (one entry per optimizer under expert parallelism, one flat entry without), the tensors in the
    shape this chain asked for, so entries by position (0, 1, ...) and one optimizer's entries
    ('optimizer', 'param_state', ...) sit side by side. Each optimizer gets the tensors it asked for,
    the saved common entries and the saved parameter groups of its own kind (dense or expert). None
    for any other state dict (it is read as it is)."""
    if not isinstance(state_dict, dict):
        return None
    positions = {k: v for k, v in state_dict.items() if isinstance(k, int) and not isinstance(k, bool)}
    rest = {k: v for k, v in state_dict.items() if k not in positions}
    if not positions or not rest or sorted(positions) != list(range(len(positions))):
        return None
    optimizers = list(chain.chained_optimizers)
    if len(optimizers) == 1 and len(positions) > 1 and "optimizer" not in rest:
        # Saved by a chain of several (common state by position), loaded by one (tensors flat).
        saved = list(positions.values())
        if not all(isinstance(s, dict) and _saved_param_groups(s) is not None for s in saved):
            return None
        merged = {**{k: v for k, v in saved[0].items() if k != "optimizer"}, **rest}
        groups = _param_groups_for(optimizers[0], saved)
        merged["optimizer"] = {**saved[0]["optimizer"], "param_groups": groups}
        return merged
    if len(optimizers) == len(positions) > 1 and _saved_param_groups(rest) is not None:
        # Saved by one optimizer (common state flat), loaded by a chain of several (tensors by position).
        common = {k: v for k, v in rest.items() if k != "optimizer"}
        reshaped = {}
        for i, optimizer in enumerate(optimizers):
            part = {**common, **positions[i]}
            groups = _param_groups_for(optimizer, [rest])
            part["optimizer"] = {**rest["optimizer"], "param_groups": groups}
            reshaped[i] = part
        return reshaped
    return None


def _saved_param_groups(saved):
    inner = saved.get("optimizer")
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return groups
    return None


def _param_group_identity(group):
    return tuple(sorted((k, repr(v)) for k, v in group.items() if k not in _NOT_GROUP_IDENTITY))


def _param_groups_for(optimizer, saved):
    """The saved parameter groups ``optimizer`` pairs its own with: every saved group of its kind,
    and, once each, the groups of the other kind whose overrides no group of its kind has, relabelled
    as its kind (the saving job held them in the other optimizer of its chain; the chain kept every
    optimizer's step the same). An optimizer whose groups are not of one kind, or carry no flag,
    gets every group."""
    every = [g for s in saved for g in _saved_param_groups(s)]
    inner = getattr(optimizer, "optimizer", None)
    kinds = {g.get(_EXPERT_FLAG) for g in getattr(inner, "param_groups", ())}
    if len(kinds) != 1 or None in kinds:
        return every
    kind = kinds.pop()
    own = [g for g in every if g.get(_EXPERT_FLAG) == kind]
    known = {_param_group_identity(g) for g in own}
    other = {}
    for g in every:
        identity = _param_group_identity(g)
        if g.get(_EXPERT_FLAG) != kind and identity not in known:
            other.setdefault(identity, {**g, _EXPERT_FLAG: kind})
    return own + list(other.values())


# -- end of replacement ---

# The reshaping under a public name (the diff keeps Megatron's module free of new public names).
in_chain_shape = _optimizer_state_in_chain_shape


@layer(ID, MODULE, FUNCTION, owner=CLASS)
def load_state_dict(below_us, self, state_dict):
    """The release's load, handed a state dict in the shape of this chain where the load mixed two
    chains' shapes (:func:`_optimizer_state_in_chain_shape`)."""
    reshaped = in_chain_shape(self, state_dict)
    if reshaped is None:
        return below_us(self, state_dict)
    saved_by = sum(isinstance(k, int) for k in state_dict) if len(self.chained_optimizers) == 1 else 1
    _tell(saved_by, len(self.chained_optimizers))
    return below_us(self, reshaped)


def _tell(saved_count, loading_count):
    rank = _rank()
    if rank in (None, 0):
        _log.info(
            "%s: the optimizer state was saved by a chain of %d optimizer(s) and loads into %d "
            "(the expert-parallel size changed): regrouped by parameter kind",
            ID,
            saved_count,
            loading_count,
        )


def _rank():
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_rank() if dist is not None and dist.is_initialized() else None
    except Exception:
        return None


# -- probe: the release's load of a mixed state dict, on stand-ins --------------------------------


class _StandIn:
    """A chained optimizer's member: records what it is asked to load."""

    def __init__(self):
        self.loaded = None
        self.optimizer = types.SimpleNamespace(param_groups=[])

    def load_state_dict(self, state_dict):
        self.loaded = state_dict


def release_outcome(module):
    """What the release's ``ChainedOptimizer.load_state_dict`` makes of a load whose common state one
    optimizer saved and whose tensors a chain of two asked for: "loads" (each optimizer gets its
    state), "stops on the count" (the bug: it counts the mixed entries), or what else it raised."""
    cls = module.__dict__[CLASS]
    chain = cls.__new__(cls)
    chain.chained_optimizers = [_StandIn(), _StandIn()]
    common = {"optimizer": {"param_groups": [{"params": [], _EXPERT_FLAG: False}]}, "param_state_sharding_type": "x"}
    try:
        original(cls, FUNCTION)(chain, {**common, 0: {"param_state": {}}, 1: {"param_state": {}}})
    except RuntimeError as exc:
        return "stops on the count" if "entries in state dict" in str(exc) else f"RuntimeError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if all(isinstance(m.loaded, dict) and "optimizer" in m.loaded for m in chain.chained_optimizers):
        return "loads"
    return "loads something else"


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or FUNCTION not in vars(cls):
        return None, f"{MODULE} has no {CLASS}.{FUNCTION}"
    if importlib.util.find_spec("megatron.training") is None:
        # The mixed state dict comes from megatron.training's save (its chained_optim_avoid_prefix
        # metadata) and load: without it here (a wheel before 0.17) the path is not measured.
        return (
            None,
            "megatron.training is not installed beside this Megatron-Core: the load this fix mends is not judged",
        )
    outcome = release_outcome(module)
    if outcome == "loads":
        return False, f"{CLASS}.{FUNCTION} gives each optimizer its state from a save of another chain length"
    if outcome != "stops on the count":
        return None, f"{CLASS}.{FUNCTION} is not the load this fix knows ({outcome[:120]})"
    return True, (
        f"{CLASS}.{FUNCTION} reads the optimizer state in the shape of the saving job's chain: a checkpoint "
        "saved under another expert-parallel size (one optimizer vs dense + expert) stops the load"
    )
