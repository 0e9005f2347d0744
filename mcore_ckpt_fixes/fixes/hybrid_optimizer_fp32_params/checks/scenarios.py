"""hybrid-optimizer-fp32-params' round trip as the suite and ``selftest`` find it (no torch, no
Megatron here): an fp32 GPT whose optimizer from ``get_megatron_optimizer`` offloads to the CPU with
``HybridDeviceOptimizer``, its ``state_dict()`` saved and loaded on 2 gloo ranks (checks/core.py);
tests/fixes/test_hybrid_optimizer_fp32_params.py also runs a bf16 model with fp32 norms and an
all-bf16 model, in the same world.
"""

from __future__ import annotations

from ....testing.registry import Bug, Scenario
from .. import ID

_CORE = f"{__package__}.core"
# The post-load hook looks up the first fp32 parameter (checks/core.py reports a tensor key by its dtype).
FP32_KEYERROR = Bug.raises("load", "KeyError: a torch.float32 tensor")

SCENARIOS = (
    Scenario(
        ID,
        "fp32",
        f"{_CORE}:fp32",
        2,
        {">=0.12.0,<=0.19.2": FP32_KEYERROR},
        prepare=f"{_CORE}:prepare",
        doc="an fp32 GPT, get_megatron_optimizer with optimizer_cpu_offload (no distributed optimizer): state_dict saved and loaded",
    ),
)
