"""expert-keys on NeMo 2 (``nemo.lightning.pytorch.strategies.megatron_strategy``, nemo-toolkit < 3.0):
a known gap, reported, not patched. Its strategy preprocesses fsdp_dtensor checkpoints itself and never
calls ``handle_experts_in_state_dict``; the probe says so and ``apply`` refuses.
"""

from __future__ import annotations

import types

from ....engine.patching import Patcher
from .. import NEMO

_NEMO_GAP = (
    "NeMo 2's MegatronStrategy._get_fsdp_dtensor_state_dict preprocesses fsdp_dtensor checkpoints "
    "without handle_experts_in_state_dict: under expert parallelism its expert keys keep their "
    "EP-local indices and EP ranks overwrite each other's experts; mcore-ckpt-fixes does not cover "
    "that path (docs/frameworks.md)"
)


def probe_nemo(module: types.ModuleType):
    """Does NeMo 2's strategy call the expert-key handling at all? (It has no parallel state of its
    own to run on stand-ins: the names its method's code refers to tell.)"""
    strategy = getattr(module, "MegatronStrategy", None)
    method = getattr(strategy, "_get_fsdp_dtensor_state_dict", None)
    code = getattr(method, "__code__", None)
    if code is None:
        return None, f"{NEMO} has no MegatronStrategy._get_fsdp_dtensor_state_dict (no fsdp_dtensor path)"
    if "handle_experts_in_state_dict" in code.co_names:
        return False, "MegatronStrategy._get_fsdp_dtensor_state_dict calls handle_experts_in_state_dict"
    return True, _NEMO_GAP


def apply_nemo(module: types.ModuleType, patcher: Patcher) -> None:
    # Reported as failed (a MegatronPatchWarning at import; `require` raises): a user of that path
    # under EP must learn that this package does not make it safe.
    raise NotImplementedError(_NEMO_GAP)
