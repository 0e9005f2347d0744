"""torch-adam-step: the distributed optimizer on torch's Adam keeps its step across a checkpoint.

Where the distributed optimizer falls back to ``torch.optim.Adam`` (no Transformer Engine, no Apex),
and with ``--optimizer-cpu-offload`` on any host, the per-parameter ``step`` does not survive a
checkpoint: (a) a load into a fresh optimizer stops with ``AssertionError``; (b) ``dp_reshardable``
gives every parameter its pre-load step, silently; (c) ``fully_reshardable`` stops with ``KeyError:
'step'``; (d) with CPU offload, (b) on the hybrid optimizer, where every resume comes back on step 1.
After any load all parameters share one step tensor, so no step matches the uninterrupted run.

Upstream: not fixed as of 0.19.2; (d) reported as NovaSky-AI/SkyRL#1403.
Affected: Megatron-Core 0.12.0-0.19.2.
The rest (the bug in detail, what the fix does, what was verified) is in doc.md in this folder.
"""

from __future__ import annotations

from ...engine.fix import Fix, Target

ID = "torch-adam-step"
MODULE = "megatron.core.optimizer.distrib_optimizer"

FIX = Fix(
    id=ID,
    summary=(
        "The distributed optimizer on torch's Adam (no Apex or Transformer Engine, or CPU offload's "
        "torch AdamW) loads into a fresh optimizer and restores every parameter's step "
        "(dp_reshardable, fully_reshardable)"
    ),
    affected=">=0.12.0,<=0.19.2",
    upstream=(
        "not fixed upstream as of Megatron-Core 0.19.2 (megatron/core/optimizer/distrib_optimizer.py)",
        "NovaSky-AI/SkyRL#1403: the stale step in load_parameter_state_from_dp_reshardable, "
        "with HybridDeviceOptimizer (--optimizer-cpu-offload), defect (d)",
    ),
    targets=(Target(MODULE),),
)
