"""torch-adam-step: the distributed optimizer on torch's Adam keeps its step across a checkpoint.

Affected: Megatron-Core 0.12.0-0.19.2 (not fixed upstream as of 0.19.2), wherever
``megatron.core.optimizer.distrib_optimizer`` falls back to ``torch.optim.Adam`` (neither Transformer
Engine nor Apex importable: ``HAVE_APEX_OR_TE`` is False), and (d) with CPU offload on any host. torch's Adam keeps a ``step`` tensor per
parameter; ``DistributedOptimizer`` saves one step in the param groups and gives it back to every
parameter on load. Three defects of that hand-over:

(a) ``DistributedOptimizer.state_dict`` asserts that exactly one per-parameter step exists
    (``assert len(steps) == 1``). A freshly built optimizer has none, and ``sharded_state_dict(...,
    is_loading=True)`` calls ``state_dict()`` first: ``load_checkpoint`` into a new optimizer stops
    with ``AssertionError`` (0.12.0-0.19.2).
(b) ``dp_reshardable`` (0.16.0+) keeps each parameter's step in the load request as a
    ``LocalNonpersistentObject`` (the step the optimizer has *before* the load) and
    ``_set_main_param_and_optimizer_states`` copies every per-parameter tensor it finds, the step
    included, after ``load_state_dict`` set the checkpoint's: with state initialised before the
    load, the moments come back and every step is the stale one (1 where the checkpoint says 3),
    so Adam's bias correction is wrong from the next step on, silently.
(c) ``fully_reshardable`` (0.15.0+) saves no per-parameter step (it is read from the param groups)
    and ``_set_main_param_and_optimizer_states`` asks the loaded tensors for one: ``KeyError: 'step'``.
(d) ``--optimizer-cpu-offload`` (``HybridDeviceOptimizer``, whatever Adam the release imported: its
    CPU optimizers are torch's ``AdamW``): (b) on the hybrid optimizer's branch of
    ``_set_main_param_and_optimizer_states`` (0.16.0+, dp_reshardable, Megatron-LM's default). A
    freshly built hybrid optimizer takes a step of its own inside ``load_state_dict``, so every
    such resume comes back on step 1, silently (NovaSky-AI/SkyRL#1403).
Besides, ``load_state_dict`` hands every parameter the same step tensor; torch's Adam increments each
parameter's step in place, so after a load one optimizer step adds one per parameter to the shared
count, and no step after the load matches the uninterrupted run. And the step stays in torch's
param groups, where torch's Adam never updates it (a run that never stopped has none there).

How (runtime/core.py): ``state_dict`` of an optimizer that has no per-parameter state yet reports
step 0 in its param groups (what torch's Adam starts from); ``_set_main_param_and_optimizer_states``
leaves each parameter's step as ``load_state_dict`` set it from the param groups (the one the
checkpoint holds) and copies only the tensors the loaded state carries; after
``load_state_dict`` every parameter owns its step tensor and torch's param groups hold no step.
Nothing changes on disk. With Transformer Engine's or Apex's FusedAdam (the step lives in the param
groups) and no CPU offload every replacement hands the call to the release's own code.
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
    targets=(Target(MODULE, f"{__name__}.runtime.core:probe", f"{__name__}.runtime.core:apply"),),
)
