"""factory-merges-non-strict in a job: the layer on ``dist_checkpointing.serialization``'s binding
of ``apply_factory_merges`` (the one ``load`` calls; ``mapping``'s own, which recurses, is left as
it is) and the probe. Why: the package's docstring, in full: doc.md."""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from ....engine.probing import in_scope, module_scope
from .. import FUNCTION, ID, MODULE

# -- replacement --- the text from here to the end marker is what the source diff inserts into
# megatron/core/dist_checkpointing/serialization.py, above load.


def _factories_loaded(loaded, factories):
    """``factories`` (the request's ShardedTensorFactory tree) without the entries ``loaded`` has no
    entry for: their tensors were left out of the request (a strictness that tolerates keys missing
    from the checkpoint leaves out the keys it lacks), so there is nothing to merge. The same object
    where nothing is left out; lists, and anything but dicts, as they are."""
    if not (isinstance(loaded, dict) and isinstance(factories, dict)):
        return factories
    kept = {key: _factories_loaded(loaded[key], value) for key, value in factories.items() if key in loaded}
    if len(kept) == len(factories) and all(kept[key] is factories[key] for key in kept):
        return factories
    return kept


# -- end of replacement ---


@layer(ID, MODULE, FUNCTION)
def apply_factory_merges(below_us, x1, x2, *args, **kwargs):
    """``load``'s merge of the factories, over those whose tensors were loaded."""
    return below_us(x1, _factories_loaded(x1, x2), *args, **kwargs)


def apply(module: types.ModuleType, patcher) -> None:
    # serialization's binding only: mapping's apply_factory_merges calls itself for nested entries.
    patcher.replace(module, FUNCTION, apply_factory_merges)


# -- probe: the release's load, a request whose one factory's tensor the checkpoint lacks ---------

PROBE_DIR = "/nonexistent/mcore_ckpt_fixes_probe"


class ProbeStrategy:
    """A load strategy (sharded and common) that reads nothing: every request loads as empty."""

    can_handle_sharded_objects = True
    stream_ckpt_dequant = False

    def load(self, *args, **kwargs):
        return {}

    def load_common(self, *args, **kwargs):
        return {}


def probe_scope(module: types.ModuleType, strategy):
    """The module's globals with the checkpoint's reads stood in: ``load_preprocess`` hands back one
    factory (key ``probe``), and the strictness check leaves its tensor out of the request, as
    log_all does for a key the checkpoint lacks. Names a release lacks are not added."""
    stand_ins = {
        "verify_checkpoint_and_load_strategy": lambda *args, **kwargs: (strategy, strategy),
        "verify_checkpoint": lambda *args, **kwargs: None,
        "verify_integrity_manifest": lambda *args, **kwargs: None,
        "load_common": lambda *args, **kwargs: {},
        "load_common_state_dict": lambda *args, **kwargs: {},
        "force_all_tensors_to_non_fp8": lambda *args, **kwargs: None,
        "load_preprocess": lambda sharded_state_dict: ({}, {}, {"probe": object()}),
        "determine_global_metadata": lambda *args, **kwargs: (None, None),
        "validate_integrity_and_strict_load": lambda *args, **kwargs: ({}, set(), {"probe"}),
    }
    present = {name: value for name, value in stand_ins.items() if name in vars(module)}
    # The release's merge, not a layer on the live binding.
    return module_scope(module, **present, **{FUNCTION: original(module, FUNCTION)})


def probe(module: types.ModuleType):
    if "load" not in vars(module) or FUNCTION not in vars(module):
        return None, f"{MODULE} has no load / {FUNCTION}"
    strategy = ProbeStrategy()
    load = in_scope(original(module, "load"), probe_scope(module, strategy))
    try:
        loaded = load({}, PROBE_DIR, sharded_strategy=strategy)
    except ValueError as exc:
        if "apply_factory_merges" not in str(exc):
            raise
        return True, f"load merges a factory whose tensor the request left out: {exc}"
    if loaded == {}:
        return False, "load merges only the factories whose tensors were loaded"
    return None, f"{MODULE}.load could not be judged: it returned {type(loaded).__name__}"
