"""tp-group's monkeypatch: wrappers that store the groups where upstream 0.19 does, the probes, apply.

See the package docstring for the bug; ``diff/core.py`` for the same change as source edits.
"""

from __future__ import annotations

import contextvars
import sys
import types

from ....engine.layers import layer
from ....engine.patching import Patcher, original
from ....engine.probing import in_scope, module_scope
from .. import ID, LAYER, MIXER, RADIO

# Groups of the MambaMixer / RADIOViTModel currently inside the patched call (None outside).
_MIXER_GROUPS = contextvars.ContextVar(  # (tp_group, dp_cp_group) or None
    "mcore_ckpt_fixes_tp_group_mixer", default=None
)
_RADIO_TP_GROUP = contextvars.ContextVar("mcore_ckpt_fixes_tp_group_radio", default=None)

_SIGNATURES: dict = {}


def _pg_collection(init, self, args, kwargs):
    """The ``pg_collection`` argument of a constructor call, wherever the release's ``init`` (whose
    signature callers follow, whatever layers sit on it) puts it."""
    sig = _SIGNATURES.get(init)
    if sig is None:
        import inspect

        sig = _SIGNATURES[init] = inspect.signature(init)
    try:
        bound = sig.bind(self, *args, **kwargs)
    except TypeError:
        return None  # let the original raise its own, better, error
    return bound.arguments.get("pg_collection")


# -- replacements (plain module-level functions: picklable by reference) ----------------------


@layer(ID, LAYER, "__init__", owner="MambaLayer")
def mamba_layer_init(below_us, self, *args, **kwargs):
    below_us(self, *args, **kwargs)
    pg = _pg_collection(original(_cls(LAYER, "MambaLayer"), "__init__"), self, args, kwargs)
    if pg is not None and getattr(self, "tp_group", None) is None:
        self.tp_group = pg.tp


@layer(ID, MIXER, "__init__", owner="MambaMixer")
def mamba_mixer_init(below_us, self, *args, **kwargs):
    below_us(self, *args, **kwargs)
    norm = getattr(self, "norm", None)
    group = getattr(self, "tp_group", None)
    if norm is not None and group is not None and type(norm).__name__ == "ExtendedRMSNorm":
        if getattr(norm, "tp_group", None) is None:
            norm.tp_group = group


@layer(ID, MIXER, "sharded_state_dict", owner="MambaMixer")
def mamba_mixer_sharded_state_dict(below_us, self, prefix="", sharded_offsets=(), metadata=None):
    dp_cp = metadata.get("dp_cp_group") if isinstance(metadata, dict) else None
    token = _MIXER_GROUPS.set((getattr(self, "tp_group", None), dp_cp))
    try:
        return below_us(self, prefix, sharded_offsets, metadata)
    finally:
        _MIXER_GROUPS.reset(token)


@layer(ID, MIXER, "make_sharded_tensors_for_checkpoint")
def mixer_make_sharded_tensors_for_checkpoint(below_us, *args, **kwargs):
    """Bound as ``megatron.core.ssm.mamba_mixer.make_sharded_tensors_for_checkpoint`` only."""
    groups = _MIXER_GROUPS.get()
    if groups is not None:
        tp_group, dp_cp_group = groups
        if kwargs.get("tp_group") is None and tp_group is not None:
            kwargs["tp_group"] = tp_group
        if kwargs.get("dp_cp_group") is None and dp_cp_group is not None:
            kwargs["dp_cp_group"] = dp_cp_group
    return below_us(*args, **kwargs)


@layer(ID, RADIO, "__init__", owner="RADIOViTModel")
def radio_vit_init(below_us, self, *args, **kwargs):
    pg = _pg_collection(original(_cls(RADIO, "RADIOViTModel"), "__init__"), self, args, kwargs)
    token = _RADIO_TP_GROUP.set(pg.tp if pg is not None else None)
    try:
        below_us(self, *args, **kwargs)
    finally:
        _RADIO_TP_GROUP.reset(token)
    if pg is not None and getattr(self, "tp_group", None) is None:
        self.tp_group = pg.tp


@layer(ID, RADIO, "ColumnParallelLinear")
def radio_column_parallel_linear(below_us, *args, **kwargs):
    """Bound as ``megatron.core.models.vision.radio.ColumnParallelLinear`` only: builds the real class."""
    group = _RADIO_TP_GROUP.get()
    if group is not None and kwargs.get("tp_group") is None:
        kwargs["tp_group"] = group
    return below_us(*args, **kwargs)


def _cls(module_name: str, name: str):
    return getattr(sys.modules[module_name], name)


# -- probes: run the real code on inert stand-ins and watch what it does --------------------------


class _Sentinel:
    """Stands in for a process group: the probes only check where it ends up."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _tiny_config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, use_cpu_initialization=True)


def probe_mamba_layer(module: types.ModuleType):
    if not hasattr(module, "MambaLayer"):
        return None, "megatron.core.ssm.mamba_layer has no MambaLayer"
    from megatron.core.transformer.identity_op import IdentityOp

    group = _Sentinel()
    sub = module.MambaLayerSubmodules(norm=IdentityOp, mixer=IdentityOp, mamba_bda=IdentityOp)
    # The release's __init__ (not the fix's, once applied) on a bare instance.
    cls = module.MambaLayer
    layer = cls.__new__(cls)
    original(cls, "__init__")(layer, _tiny_config(), sub, pg_collection=types.SimpleNamespace(tp=group))
    if getattr(layer, "tp_group", None) is group:
        return False, "MambaLayer stores pg_collection.tp as tp_group"
    return True, "MambaLayer does not store tp_group"


class _ProbeDone(Exception):
    pass


def probe_mamba_mixer(module: types.ModuleType):
    if not hasattr(module, "MambaMixer") or not hasattr(module, "make_sharded_tensors_for_checkpoint"):
        return None, "megatron.core.ssm.mamba_mixer lacks MambaMixer or make_sharded_tensors_for_checkpoint"
    import torch

    seen = {}

    def recorder(*args, **kwargs):
        seen.update(kwargs)
        raise _ProbeDone

    stub = torch.nn.Module()  # empty: the first helper call is all the probe needs to see
    stub.tp_group = _Sentinel()
    # The release's method in a copy of the module's globals with the recorder: the live module is
    # left as it is.
    method = in_scope(
        original(module.MambaMixer, "sharded_state_dict"),
        module_scope(module, make_sharded_tensors_for_checkpoint=recorder),
    )
    try:
        method(stub, "", (), {"dp_cp_group": _Sentinel()})
    except _ProbeDone:
        pass
    if not seen:
        return None, "MambaMixer.sharded_state_dict no longer calls make_sharded_tensors_for_checkpoint"
    if seen.get("tp_group") is stub.tp_group:
        return False, "MambaMixer.sharded_state_dict passes its tp_group"
    return True, "MambaMixer.sharded_state_dict calls make_sharded_tensors_for_checkpoint without tp_group"


def probe_radio(module: types.ModuleType):
    if not hasattr(module, "RADIOViTModel") or not hasattr(module, "ColumnParallelLinear"):
        return None, "megatron.core.models.vision.radio lacks RADIOViTModel or ColumnParallelLinear"
    from megatron.core.transformer.identity_op import IdentityOp

    seen = []

    def fake_linear(*args, **kwargs):
        seen.append(kwargs.get("tp_group"))
        return IdentityOp()

    group = _Sentinel()
    # The release's __init__ in a copy of the module's globals with the stand-ins: the live module
    # is left as it is.
    cls = module.RADIOViTModel
    init = in_scope(
        original(cls, "__init__"),
        module_scope(module, ColumnParallelLinear=fake_linear, TransformerBlock=lambda *a, **k: IdentityOp()),
    )
    model = cls.__new__(cls)
    init(
        model,
        _tiny_config(),
        None,
        patch_dim=4,
        img_h=4,
        img_w=4,
        max_img_h=4,
        max_img_w=4,
        pg_collection=types.SimpleNamespace(tp=group),
    )
    # 0.19 stores the group through a helper that yields None outside torch.distributed: what
    # matters is that the model keeps a tp_group of its own instead of asking parallel_state.
    stored = "tp_group" in model.__dict__
    embedder = bool(seen) and all(g is group for g in seen)
    if stored and embedder:
        return False, "RADIOViTModel stores tp_group and hands it to its patch embedder"
    missing = [w for w, ok in (("tp_group", stored), ("embedder tp_group", embedder)) if not ok]
    return True, "RADIOViTModel is missing " + " and ".join(missing)


# -- apply ---------------------------------------------------------------------------------------


def apply_mamba_layer(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.MambaLayer, "__init__", mamba_layer_init)


def apply_mamba_mixer(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.MambaMixer, "__init__", mamba_mixer_init)
    patcher.replace(module.MambaMixer, "sharded_state_dict", mamba_mixer_sharded_state_dict)
    # Namespace-local on purpose: every other caller of the helper passes its groups already.
    patcher.replace(module, "make_sharded_tensors_for_checkpoint", mixer_make_sharded_tensors_for_checkpoint)


def apply_radio(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace(module.RADIOViTModel, "__init__", radio_vit_init)
    # Namespace-local: only RADIO's own embedder construction goes through the replacement.
    patcher.replace(module, "ColumnParallelLinear", radio_column_parallel_linear)
