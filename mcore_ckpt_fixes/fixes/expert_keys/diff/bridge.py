"""expert-keys' source edit of Megatron-Bridge (patches/expert-keys/megatron-bridge-<version>.patch).

The runtime (``runtime/bridge.py``) rebinds Bridge's ``preprocess_state_dict_for_uneven_dtensor``; the
diff is the minimal edit that makes Bridge import the patched one (apply with Megatron-Core's diff).
"""

from __future__ import annotations

from ....sourcediff import PatchgenError, insert_before
from .core import TRAINING_ANCHOR

# Megatron-Bridge binds the uneven-DTensor preprocessing the same way (same anchor). Its diff takes the
# patched preprocessing where Megatron-Core carries patches/expert-keys (which defines it), and keeps
# Megatron-FSDP's own otherwise: an ImportError here must not switch Bridge's Megatron-FSDP support off.
BRIDGE_FILE = "megatron/bridge/training/checkpointing.py"
BRIDGE_IMPORT = (
    "    try:  # Megatron-Core with patches/expert-keys: single grouped expert tensors made EP-global too\n"
    "        from megatron.core.transformer.fsdp_dtensor_checkpoint import preprocess_state_dict_for_uneven_dtensor\n"
    "    except ImportError:\n"
    "        pass\n"
)


def source_edits(version: str) -> list:
    """Bridge's checkpointing imports the patched preprocessing (measured: megatron-bridge 0.6.2)."""
    if version != "0.6.2":
        raise PatchgenError(f"expert-keys has no edits for megatron-bridge-{version} (measured: megatron-bridge-0.6.2)")
    return [insert_before(BRIDGE_FILE, TRAINING_ANCHOR, BRIDGE_IMPORT)]
