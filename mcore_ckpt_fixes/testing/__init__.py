"""The round-trip contract every fix's scenarios share, used by the test suite and ``selftest``.

* :mod:`.registry`: :class:`~.registry.Scenario` and :class:`~.registry.Bug` (how a fix declares a
  round trip and what its fix-off half shows), found per fix package (no shared list);
* :mod:`.result`: :class:`~.result.RoundTrip`, the one result type, phase tracking and error policy;
* :mod:`.compare`: tensor comparison; :mod:`.meshes`: CPU device meshes; :mod:`.states`: the fix
  state a world must run under; :mod:`.launcher`, :mod:`.worker`: worlds of ranks with a deadline;
  :mod:`.placement`: the device a scenario's tensors live on; :mod:`.world_errors`: one failure
  reported alike by every rank.

Private, installed only inside the worlds the tests and ``selftest`` start (they replace modules in
``sys.modules`` or other packages' globals): :mod:`._standins` (``mamba_ssm``, Transformer Engine for
Megatron-Bridge's import chain), :mod:`._fused_adam` (Megatron's optimizers see a CPU FusedAdam as
Apex's), :mod:`._cpu_shims` (Megatron's CUDA-only calls on a CPU host), :mod:`._rng_standin` (the
CUDA RNG tracker on a CPU host).

Nothing here is imported by ``import mcore_ckpt_fixes``; CPU shims are installed only in workers.
Only :mod:`.registry` is light (no torch): the rest is imported inside test and selftest processes.
"""

from .registry import Bug, Scenario, all_scenarios, for_fix, resolve

__all__ = ["Bug", "Scenario", "all_scenarios", "for_fix", "resolve"]
