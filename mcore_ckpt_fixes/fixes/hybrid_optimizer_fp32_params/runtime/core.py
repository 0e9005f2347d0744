"""hybrid-optimizer-fp32-params' monkeypatch on ``megatron.core.optimizer.cpu_offloading.hybrid_optimizer``:
a wrapper of ``HybridDeviceOptimizer._update_fp32_params_by_new_state``, and the probe. Why: the
package's docstring. Imported only when the target module is.

The wrapper hands the call to the release's own method, over the parameters that have an fp32 copy;
where every parameter has one (a bf16 model), or the optimizer does not update in fp32, the call is
the release's unchanged.
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import original
from .. import ID, MODULE

CLASS = "HybridDeviceOptimizer"
METHOD = "_update_fp32_params_by_new_state"


def without_fp32_copy(self) -> list:
    """The parameters of the optimizer's state that ``param_to_fp32_param`` does not map: those
    that were fp32 already when the optimizer split its parameters (no copy was made)."""
    copies = self.param_to_fp32_param
    return [p for p in self.state if p not in copies]


@layer(ID, MODULE, METHOD, owner=CLASS)
def update_fp32_params_by_new_state(release, self):
    """``HybridDeviceOptimizer._update_fp32_params_by_new_state`` over the parameters that have an
    fp32 copy. The release looks every parameter of the state up in ``param_to_fp32_param`` and
    raises ``KeyError`` for one that is fp32 itself. Such a parameter (or its CPU copy, which the
    post-load hook has just rebuilt from it) is what the optimizer updates: it keeps what the load
    restored, and its loaded ``master_param`` is the value it was saved with."""
    if not getattr(self, "param_update_in_fp32", False) or not without_fp32_copy(self):
        return release(self)
    state = self.state
    # The release's own copying, on the mapped parameters only; the state is put back whatever happens.
    self.state = {p: v for p, v in state.items() if p in self.param_to_fp32_param}
    try:
        return release(self)
    finally:
        self.state = state


# -- probe: the release's own method on an inert stand-in -------------------------------------------


def release_raises_for_fp32_param(cls) -> bool:
    """Does the release's method stop on a parameter that has no fp32 copy (an fp32 parameter)?"""
    import torch

    fn = original(cls, METHOD)  # the release's, even after apply
    param = torch.zeros(2)
    stand_in = types.SimpleNamespace(
        param_update_in_fp32=True, param_to_fp32_param={}, state={param: {"master_param": torch.ones(2)}}
    )
    try:
        fn(stand_in)
    except KeyError:
        return True
    return False


def probe(module: types.ModuleType):
    cls = module.__dict__.get(CLASS)
    if cls is None or METHOD not in cls.__dict__:
        return None, f"{MODULE} has no {CLASS}.{METHOD}"
    if not release_raises_for_fp32_param(cls):
        return False, f"{CLASS}.{METHOD} skips parameters that are fp32 already"
    return True, f"{CLASS}.{METHOD} raises KeyError for a parameter that is fp32 already (no fp32 copy)"
