"""load-main-params-substring-match's monkeypatch on ``megatron.core.optimizer.distrib_optimizer``:
``DistributedOptimizer._build_model_param_to_state_dict_param_map`` replaced, the probe and apply.
Why: the package's docstring. Imported only when the target module is.

The replacement is the release's method with one line changed: the keys a parameter matches come
from :func:`_state_dict_keys_naming` (the text the source diff inserts) instead of ``name in k``.
The rest of the method (the chunk keys, the one-match and shape assertions, each key taken once)
is the release's, so every state dict the release maps is mapped alike.
"""

from __future__ import annotations

import types

from ....engine.patching import Patcher, is_replacement, mark, original
from .. import ID, MODULE

METHOD = "_build_model_param_to_state_dict_param_map"

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/optimizer/distrib_optimizer.py, above class DistributedOptimizer.


def _state_dict_keys_naming(name, keys):
    """The state-dict keys that parameter ``name`` matches when main parameters are reloaded from a
    state dict: those containing the name, and where that is more than one, the key equal to it,
    else the one key ending with "." + name (keys with a prefix). Transformer Engine's grouped
    experts name one tensor per local expert (weight0, weight1, ...): with 11 or more, weight1 is
    part of weight10 and weight11 too. Several keys none of which names the parameter stay several."""
    matches = [k for k in keys if name in k]
    if len(matches) > 1:
        for own in ([k for k in matches if k == name], [k for k in matches if k.endswith("." + name)]):
            if len(own) == 1:
                return own
    return matches


# -- end of replacement ---


def _state_dicts_per_chunk(self, state_dict):
    """The model chunks' state dicts, as the release's method finds them (its assertions kept)."""
    if "model0" in state_dict or "model_0" in state_dict:
        prefix = "model" if "model0" in state_dict else "model_"
        out = []
        for i in range(len(self.model_chunks)):
            k = f"{prefix}{i}"
            assert k in state_dict, f"Wrong state_dict format, cannot find '{k}'"
            out.append(state_dict[k])
        return out
    assert len(self.model_chunks) == 1
    return [state_dict["model"] if "model" in state_dict else state_dict]


@mark(ID)
def build_model_param_to_state_dict_param_map(self, state_dict):
    """``DistributedOptimizer._build_model_param_to_state_dict_param_map``: each model parameter's
    tensor in ``state_dict``, found by the key that names it."""
    state_dict_list = _state_dicts_per_chunk(self, state_dict)
    model_param_to_state_dict_param_map = {}
    for chunk_idx, model_chunk in enumerate(self.model_chunks):
        names_in_state_dict = set(state_dict_list[chunk_idx].keys())
        for name, model_param in model_chunk.named_parameters():
            while name.startswith("module."):
                name = name[len("module.") :]
            matched_keys = _state_dict_keys_naming(name, names_in_state_dict)
            assert len(matched_keys) == 1, f"Parameter {name} has {len(matched_keys)} matches in state dict"
            state_dict_param = state_dict_list[chunk_idx][matched_keys[0]]
            assert model_param.shape == state_dict_param.shape
            model_param_to_state_dict_param_map[model_param] = state_dict_param
            names_in_state_dict.remove(matched_keys[0])
    return model_param_to_state_dict_param_map


# -- probe: the release's own method on a stand-in optimizer (no model, no torch) ------------------


class ProbeTensor:
    """A parameter or state-dict tensor as the method sees it: hashable, with a shape."""

    shape = (4,)


class ProbeModelChunk:
    """A model chunk as DDP names its parameters: ``module.`` in front, one per grouped expert."""

    def __init__(self, names):
        self.params = [(f"module.module.{n}", ProbeTensor()) for n in names]

    def named_parameters(self):
        return iter(self.params)

    def named_modules(self):
        return iter(())  # from 0.18.0 the method also looks for grouped linear modules: none here


def _release_method(cls):
    fn = cls.__dict__[METHOD]
    return original(cls, METHOD) if is_replacement(fn) else fn


def maps_a_parameter_to_another_key(cls) -> bool:
    """Eleven grouped experts' weights (weight0 .. weight10): does the release stop on weight1, or
    give any parameter another key's tensor?"""
    names = [f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}" for i in range(11)]
    state_dict = {n: ProbeTensor() for n in names}
    stand_in = object.__new__(cls)
    stand_in.model_chunks = [ProbeModelChunk(names)]
    try:
        mapping = _release_method(cls)(stand_in, {"model": state_dict})
    except AssertionError:
        return True
    return any(mapping.get(p) is not state_dict[n] for n, (_, p) in zip(names, stand_in.model_chunks[0].params))


def probe(module: types.ModuleType):
    cls = module.__dict__.get("DistributedOptimizer")
    if cls is None or METHOD not in cls.__dict__:
        return None, f"{MODULE}'s DistributedOptimizer reloads no main parameters from a state dict"
    if not maps_a_parameter_to_another_key(cls):
        return False, "each parameter matches the one state-dict key that names it"
    return True, (
        "DistributedOptimizer.reload_model_params(state_dict) matches a parameter to every key its name is part of "
        "(linear_fc1.weight1 also matches weight10): the load stops"
    )


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.DistributedOptimizer, METHOD, build_model_param_to_state_dict_param_map)
