"""gdn-fsdp-split, the monkeypatch: the probe that finds the bug in a release's own
``handle_gdn_in_state_dict``, and ``apply``, which binds :mod:`.split`'s replacement (marked as this
fix's) in the target module and every module that imported the function by name. Imported only when
``megatron.core.transformer.fsdp_dtensor_checkpoint`` is.
"""

from __future__ import annotations

import sys
import types

from ....engine.patching import Patcher, is_replacement, mark, original
from ....engine.probing import in_scope, module_scope
from .. import ID, MODULE, NAME
from . import split

# The upstream-shaped function is bound as it is (no wrapper); marking it in place lets the engine
# and the probe tell it from the release's own (a reload re-probes the original, not the fix). It is
# read as ``split.handle_gdn_in_state_dict``, never bound here by name: revert() points every
# module global holding a reverted replacement back at the original, except in the defining module.
mark(ID)(split.handle_gdn_in_state_dict)


# -- probe: the real function on inert stand-ins ---------------------------------------------------


class _ProbeDone(Exception):
    pass


# TP-local in_proj of the probe's GDN: q,k,v,z = 2 rows, b,a = 1; TP=2.
_TP, _ROWS, _COLS = 2, 2 + 2 + 2 + 2 + 1 + 1, 4


def probe(module: types.ModuleType):
    fn = module.__dict__.get(NAME)
    if is_replacement(fn):
        fn = original(module, NAME)  # re-probed after apply (reload): judge upstream's code
    if fn is None:
        return None, f"{MODULE} has no {NAME} (GDN support absent)"
    if not getattr(module, "HAVE_MEGATRON_FSDP", False):
        return None, "Megatron-FSDP is not importable here"
    import torch

    mesh = types.SimpleNamespace(mesh_dim_names=("tp",), size=lambda dim=0: _TP, get_local_rank=lambda dim=0: 0)
    built = []  # (local rows, global rows) of every DTensor a collective-free split builds itself
    fake = _fake_dtensor_class(mesh, built)
    seen = _run_on_stand_ins(module, fn, _probe_model(torch, mesh), fake(torch.zeros(_ROWS, _COLS)), fake)
    return _verdict(seen, built)


def _fake_dtensor_class(mesh, built):
    """A class standing in for DTensor in the module's namespace only, during the probe; records in
    ``built`` what a split that builds its DTensors itself asks for."""

    class FakeDTensor:
        device_mesh, placements = mesh, ()

        def __init__(self, local, shape=None):
            self.local, self._local_tensor = local, local
            self.shape = local.shape if shape is None else shape

        def numel(self):
            return self.local.numel()

        def to_local(self):
            return self.local

        @classmethod
        def from_local(cls, local, device_mesh=None, placements=None, run_check=False, shape=None, stride=None):
            built.append((local.shape[0], shape[0]))
            return cls(local, shape)

    return FakeDTensor


def _probe_model(torch, mesh):
    """``module.gdn``: what the handler reads of a TP=2 GatedDeltaNet, its in_proj a meta parameter
    with Megatron-FSDP's attributes (one rank holding the whole TP-local tensor)."""
    tp = _TP

    class Gdn(torch.nn.Module):
        qk_dim, v_dim, in_proj_dim, num_value_heads, tp_size = 2 * tp, 2 * tp, 10 * tp, 1 * tp, tp

        def __init__(self):
            super().__init__()
            self.in_proj = torch.nn.Module()
            w = torch.nn.Parameter(torch.empty(_ROWS * tp, _COLS, device="meta"))
            w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 1
            w.megatron_fsdp_slice = slice(0, _ROWS * _COLS)
            w.megatron_fsdp_dist_index = types.SimpleNamespace(
                tp_dim="tp", device_mesh=mesh, get_submesh=lambda *a, **k: types.SimpleNamespace(mesh=torch.empty(tp))
            )
            self.in_proj.weight = w

    model = torch.nn.Module()
    model.module = torch.nn.Module()
    model.module.gdn = Gdn()
    return model


def _run_on_stand_ins(module, fn, model, data, fake):
    """Call ``fn`` on ``data`` (the TP-local in_proj) with the module's DTensor and Megatron-FSDP
    helpers as stand-ins; which helper got which local tensor."""
    seen = {}

    def record(name):
        def recorder(local_tensor, *args, **kwargs):
            seen[name] = local_tensor
            raise _ProbeDone

        return recorder

    # In a copy of the module's globals: the live module is left as it is.
    home = sys.modules.get(fn.__module__, module)  # where fn reads its globals
    scope = module_scope(
        home, DTensor=fake, make_fsdp_dtensor=record("make_fsdp_dtensor"), split_dtensor=record("split_dtensor")
    )
    try:
        in_scope(fn, scope)(model, {"gdn.in_proj.weight": data}, None)
    except _ProbeDone:
        pass
    return seen


def _verdict(seen, built):
    if "split_dtensor" in seen:
        return True, (
            "split_gdn_fused picks a per-rank fast path (split_dtensor) for TP-local DTensors whose "
            "collectives differ from the other branch (hang risk, #4910)"
        )
    if "make_fsdp_dtensor" in seen:
        got = seen["make_fsdp_dtensor"].numel()
        if got != 2 * _COLS:
            return (
                True,
                f"split_gdn_fused splits a TP-local tensor by TP again (query got {got} of {2 * _COLS} elements)",
            )
        return False, "split_gdn_fused keeps a TP-local tensor's component sizes"
    if built:
        # No Megatron-FSDP helper (and so no collective) was called: the split was computed locally
        # (this package's version, or its source diff). Query: 2 local rows of a 2 * tp-row tensor.
        if built[0] == (2, 2 * _TP):
            return False, "the GDN split is computed locally on every rank (no per-rank branch, no collective)"
        return True, f"the GDN split gives query {built[0][0]} of {built[0][1]} rows (expected 2 of {2 * _TP})"
    return None, "handle_gdn_in_state_dict no longer calls make_fsdp_dtensor or split_dtensor"


def apply(module: types.ModuleType, patcher: Patcher) -> None:
    patcher.replace_function(module, NAME, split.handle_gdn_in_state_dict)
