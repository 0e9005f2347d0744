"""numpy2-product's monkeypatch: the name ``np`` of each target module bound to
:mod:`.numpy_with_product`. Why: the package's docstring. Imported only when a target module is.

The probe runs the release's own function that calls ``np.product`` (one per module: ``PROBES``) on
a stand-in shard with the NumPy the release's module imported, so it answers for the NumPy
installed: with NumPy 1 the release works and the fix is not needed.
"""

from __future__ import annotations

import importlib
import types

from ....engine.patching import Patcher, is_replacement, original
from .. import MODULES


def _flat_shard(**kw):
    """A ``ShardedTensor`` as the three functions read it: its shape, a flattened range, main replica."""
    import torch

    fields = {"local_shape": (2, 3), "flattened_range": slice(0, 6), "replica_id": 0, "dtype": torch.float32}
    fields.update(kw)
    return types.SimpleNamespace(**fields)


def _shard_size(module):
    fn = module.__dict__.get("_shard_size")
    return fn and (fn, (_flat_shard(flattened_range=None),))


def _flattened_coverage(module):
    fn = module.__dict__.get("_validate_sharding_for_key_flattened")
    return fn and (fn, ([_flat_shard()],))


def _local_coordinates(module):
    cls = module.__dict__.get("ShardedTensor")
    fn = cls and cls.__dict__.get("local_coordinates")
    return fn and (fn, (_flat_shard(),))


# target module -> what of it calls np.product: (function, stand-in arguments), or None when absent
PROBES = dict(zip(MODULES, (_shard_size, _flattened_coverage, _local_coordinates)))


def _release_numpy(module):
    current = module.__dict__.get("np")
    return original(module, "np") if is_replacement(current) else current


def release_needs_product(module) -> bool | None:
    """Does the module's function stop on ``np.product`` with the NumPy installed? None: the
    module has no such function (0.16.0 on, for two of the three)."""
    found = PROBES[module.__name__](module)
    if not found or _release_numpy(module) is None:
        return None
    fn, args = found
    # The release's code with the release's NumPy, even after apply.
    release = types.FunctionType(
        fn.__code__, {**fn.__globals__, "np": _release_numpy(module)}, fn.__name__, fn.__defaults__, fn.__closure__
    )
    try:
        release(*args)
    except AttributeError as e:
        if "product" in str(e):
            return True
        raise
    return False


def probe(module: types.ModuleType):
    verdict = release_needs_product(module)
    if verdict is None:
        return None, f"{module.__name__} has no function that calls np.product"
    if not verdict:
        return False, f"{module.__name__} runs with this NumPy ({_release_numpy(module).__version__})"
    return True, f"{module.__name__} calls np.product, which NumPy {_release_numpy(module).__version__} does not have"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    # Imported by name, not bound here: revert() points every binding of a replacement back at the
    # original, and only the package attribute of a replacement module counts as its definition.
    patcher.replace(module, "np", importlib.import_module(f"{__package__}.numpy_with_product"))
