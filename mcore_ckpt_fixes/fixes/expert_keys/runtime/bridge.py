"""expert-keys on Megatron-Bridge (``megatron.bridge.training.checkpointing``, gated by Megatron-Core's
version: the missing grouped handling is Megatron-Core's): Bridge binds the uneven-DTensor
preprocessing by name, as ``megatron.training`` does; this rebinds Bridge's binding only. Imported only
when Bridge's checkpointing module is.
"""

from __future__ import annotations

import types

from ....engine.patching import Patcher, mark
from .. import BRIDGE, ID
from .core import preprocess_through_binding, probe_training


@mark(ID)
def bridge_preprocess_state_dict_for_uneven_dtensor(state_dict):
    """Megatron-Bridge's binding (its ``preprocess_fsdp_dtensor_state_dict`` calls it)."""
    return preprocess_through_binding(BRIDGE, bridge_preprocess_state_dict_for_uneven_dtensor, state_dict)


probe_bridge = probe_training


def apply_bridge(module: types.ModuleType, patcher: Patcher) -> None:
    # Megatron-Bridge's binding only, as for megatron.training: see BRIDGE.
    patcher.replace(module, "preprocess_state_dict_for_uneven_dtensor", bridge_preprocess_state_dict_for_uneven_dtensor)
