"""Stand-ins for packages whose kernels cannot be installed on a CPU host (test and selftest only).

``mamba_ssm`` (see :func:`install_mamba_ssm_stand_in`): ``MambaMixer`` needs it, and its Triton/CUDA
kernels cannot be installed on a CPU host. Megatron imports from it

* ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: the base class of ``ExtendedRMSNorm``, the
  mixer's gated norm. Without the package Megatron substitutes a ``MagicMock`` and the norm (with
  its TP-sharded ``weight``, a tensor tp-group's fix is about) would not be a real module. The
  stand-in is a ``torch.nn.Module`` with the same constructor and a ``weight`` Parameter of size
  ``hidden_size``: exactly what the checkpoint sees of the real one (forward is not provided).
* the kernels ``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined`` (and, in 0.16,
  ``selective_state_update``): only called in forward, which a checkpoint round trip never runs;
  they raise ``NotImplementedError``.

``causal_conv1d`` is optional in every release (Megatron falls back to ``None``), so it is not
stood in for. A real ``mamba_ssm`` installation always wins.

Transformer Engine's ``quantize_param_shard`` for an empty list (see
:func:`install_fp8_param_shard_stand_in`): 0.12.x's fallback without Transformer Engine raises on
every step of the distributed optimizer, even with no FP8 parameter.
"""

from __future__ import annotations

import sys
import types

import torch


class _GatedRMSNormStandIn(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``'s parameters, without its Triton forward."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)  # as the real one

    def forward(self, *args, **kwargs):
        raise NotImplementedError("mamba_ssm stand-in: gated RMSNorm forward is not available")


def _kernel(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"mamba_ssm stand-in: {name} is a CUDA kernel, not available here")

    kernel.__name__ = name
    return kernel


def install_mamba_ssm_stand_in() -> None:
    """Register the stand-in ``mamba_ssm`` in ``sys.modules``; must run before ``mamba_mixer`` imports."""
    mixer = sys.modules.get("megatron.core.ssm.mamba_mixer")
    if mixer is not None:
        if not getattr(mixer, "HAVE_MAMBA_SSM", False):
            # Its ExtendedRMSNorm is then a MagicMock. Reloading would replace the classes the fix
            # engine patched, so refuse instead of testing something else than the fix.
            raise RuntimeError(
                "megatron.core.ssm.mamba_mixer was imported without mamba_ssm; call "
                "mcore_ckpt_fixes.testing._standins.install_mamba_ssm_stand_in() before importing it"
            )
        return
    if "mamba_ssm" in sys.modules:
        return  # a real mamba_ssm (or our stand-in) is already there
    try:
        import mamba_ssm  # noqa: F401  (a real installation wins)

        return
    except ImportError:
        pass
    names = ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"]
    leaves = {
        "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": _GatedRMSNormStandIn},
        "mamba_ssm.ops.triton.ssd_combined": {
            n: _kernel(n) for n in ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined")
        },
        "mamba_ssm.ops.triton.selective_state_update": {  # imported from here by 0.16 only
            "selective_state_update": _kernel("selective_state_update")
        },
    }
    for name in names + list(leaves):
        mod = types.ModuleType(name, "stand-in registered by mcore_ckpt_fixes.testing._standins")
        mod.__dict__.update(leaves.get(name, {}))
        if name in names:
            mod.__path__ = []  # a package, so the submodules resolve
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)
    sys.modules["mamba_ssm"].__version__ = "0.0.0"  # only read by forward-time version checks


# -- transformer_engine, for Megatron-Bridge's import only ------------------------------------------
#
# ``megatron.bridge.training.checkpointing`` imports the whole ``megatron.bridge`` package, and one
# module of it, ``megatron.bridge.peft.lora_layers``, imports ``transformer_engine.pytorch`` without
# a fallback (every other import of Transformer Engine on that path is a try/except). Transformer
# Engine cannot be installed without CUDA. What ``lora_layers`` evaluates while it is imported is its
# return annotations ``te.ops.Sequential``; everything else it takes from TE runs only when a LoRA
# adapter is built with TE layers, which a checkpoint round trip never does.
#
# The stand-in is visible to that one module body and nothing else: it sits in ``sys.modules`` only
# while ``lora_layers`` executes and is removed right after. Megatron-Core's own probes
# (``try: import transformer_engine``, ``get_te_version()``, which caches what it finds) therefore
# still see no Transformer Engine, as on any CPU host, and choose their non-TE paths.

_TE_STAND_IN_FOR = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")


class _TEOpStandIn:
    """``transformer_engine.pytorch.ops.Sequential``: a name for annotations, never built here."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("transformer_engine stand-in: TE fused ops are not available on this host")


def _te_stand_in_modules():
    doc = f"stand-in registered by mcore_ckpt_fixes.testing._standins for {_TE_STAND_IN_FOR} only"
    mods = {name: types.ModuleType(name, doc) for name in _TE_NAMES}
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        mods[name].__path__ = []
    mods["transformer_engine.pytorch.ops"].Sequential = _TEOpStandIn
    mods["transformer_engine"].pytorch = mods["transformer_engine.pytorch"]
    mods["transformer_engine.pytorch"].ops = mods["transformer_engine.pytorch.ops"]
    return mods


class _TEStandInLoader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        mods = _te_stand_in_modules()
        for name, mod in mods.items():
            sys.modules.setdefault(name, mod)
        try:
            self._loader.exec_module(module)
        finally:
            for name, mod in mods.items():
                if sys.modules.get(name) is mod:
                    del sys.modules[name]

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _TEStandInFinder:
    """Finds ``lora_layers`` through the other finders and wraps its loader (see above)."""

    def __init__(self):
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TE_STAND_IN_FOR or self._busy:
            return None
        self._busy = True  # the other finders may ask the meta path again (post-import hooks)
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy = False
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _TEStandInLoader(spec.loader)
        return spec


def install_transformer_engine_stand_in_for_bridge() -> None:
    """Let ``megatron.bridge`` import on a host without Transformer Engine (see above); must run
    before ``megatron.bridge`` is imported. A real ``transformer_engine`` always wins."""
    if _TE_STAND_IN_FOR in sys.modules or any(isinstance(f, _TEStandInFinder) for f in sys.meta_path):
        return
    import importlib.util

    try:
        if importlib.util.find_spec("transformer_engine") is not None:
            return
    except (ImportError, ValueError):
        pass
    sys.meta_path.insert(0, _TEStandInFinder())


def install_fp8_param_shard_stand_in() -> None:
    """Let 0.12.x's distributed optimizer step without Transformer Engine, as it steps with it.

    Every step of 0.12's distributed optimizer calls ``fp8_utils.quantize_param_shard`` with the
    FP8 parameters among its shards, an empty list when there are none. Transformer Engine's
    implementation returns for an empty list; 0.12's fallback for a host without it raises
    ``Invalid Transformer Engine version`` whatever it is given, so no bf16 or fp32 model could
    step here. The stand-in returns for an empty list, as Transformer Engine's code and 0.13's
    fallback do, and hands anything else to the release's fallback (which raises as before). A
    release whose fallback already takes an empty list, or a host with Transformer Engine, is
    left as it is. It is put in place when ``megatron.core.fp8_utils`` is imported (at once if it
    is already): the worker itself imports nothing of Megatron.
    """
    from ..engine import hooks

    hooks.register("megatron.core.fp8_utils", empty_list_stand_in)


def empty_list_stand_in(fp8_utils) -> None:
    """Put the stand-in into ``fp8_utils`` (a ``megatron.core.fp8_utils``) where its fallback refuses an
    empty list; once."""
    fallback = getattr(fp8_utils, "_quantize_param_shard_impl", None)
    if fallback is None or getattr(fallback, "_empty_list_stand_in", False):
        return
    try:
        fallback([], [], [], None)
        return  # the release (or Transformer Engine) already takes an empty list
    except RuntimeError:
        pass

    def _quantize_param_shard_impl(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return fallback(model_params, *args, **kwargs)

    _quantize_param_shard_impl._empty_list_stand_in = True
    fp8_utils._quantize_param_shard_impl = _quantize_param_shard_impl
