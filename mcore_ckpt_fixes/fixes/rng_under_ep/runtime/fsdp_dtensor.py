"""rng-under-ep in the ``fsdp_dtensor`` format (Megatron-FSDP users' format).

Megatron stores the RNG state there as a plain entry ``{"(pp, tp)": [state, ...]}`` in the DCP
state dict. Every rank of one (pp, tp) writes the same keys, so DCP keeps one copy of each leaf —
and not even one rank's: the tensors (torch's CPU state, the CUDA and tracker states) and the
objects (Python's and NumPy's states) are written by different ranks. After a resume every rank of
a (pp, tp) restores that mix, so expert-parallel ranks > 0 draw another rank's router noise and
expert dropout.

With the fix every rank saves, beside the release's entry, its own under ``"(pp, tp, dp_cp)"``
((pp, tp, dp_cp) names every rank of the dense grid once; EP lives inside it), a separate copy
so the two entries never share a tensor. The release's entry stays as the release writes it, so an
unfixed Megatron-Core reads a fixed checkpoint exactly as it reads its own.

A load asks for both (``get_rng_state`` describes the request). Where the checkpoint has no entry
for this rank, load_checkpoint's DCP planner (``default_planner`` as ``megatron.training.checkpointing``
binds it, replaced there only) leaves it out of the plan: decided from the checkpoint's metadata,
which DCP reads for the load anyway (no byte more is read), so the load works in strict mode too
(``strict_fsdp_dtensor_load``, the default from 0.17) exactly where the release's own load works.
After the load:

* this rank's own entry was there: it is handed to ``load_checkpoint`` under ``"(pp, tp)"``, the
  key it looks up, and restored;
* only the release's entry (a checkpoint written before the fix, or with a smaller data-parallel
  size): that copy is restored, as an unfixed release does, with a ``MegatronPatchWarning`` that
  names the old layout: never silently.
"""

from __future__ import annotations

import copy
import re

from ....engine.patching import mark
from .. import ID

_PP_TP_KEY = re.compile(r"^\((\d+), (\d+)\)$")
_MARKER_LEAF = "random_rng_state"  # an object leaf of every entry (Python's random state: a tuple)


def fsdp_dtensor_entry(state):
    """``(pp, tp)`` of an ``fsdp_dtensor`` RNG entry as ``get_rng_state`` returns it, else None."""
    if not isinstance(state, dict):
        return None
    for key in state:
        found = _PP_TP_KEY.match(key) if isinstance(key, str) else None
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def _keys(state, dp_cp_rank):
    pp, tp = fsdp_dtensor_entry(state)
    return f"({pp}, {tp})", f"({pp}, {tp}, {dp_cp_rank})"


def with_per_rank_entry(state, dp_cp_rank):
    """``state`` with this rank's own entry added under ``"(pp, tp, dp_cp)"`` (a deep copy)."""
    release_key, own_key = _keys(state, dp_cp_rank)
    out = dict(state)
    out[own_key] = copy.deepcopy(state[release_key])
    return out


def own_entry_key(request):
    per_rank = [k for k in request if isinstance(k, str) and k.count(",") == 2]
    return per_rank[0] if len(per_rank) == 1 else None


def drop_absent_own_entry(state_dict, stored_keys) -> None:
    """Before DCP plans a load: leave this rank's own RNG entry out of ``state_dict`` when the
    checkpoint (``stored_keys``: its metadata's keys) holds the release's entry but not this one."""
    rng = state_dict.get("rng_state") if isinstance(state_dict, dict) else None
    own_key = own_entry_key(rng) if fsdp_dtensor_entry(rng) is not None else None
    if own_key is None:
        return
    pp, tp = fsdp_dtensor_entry(rng)

    def stored(key):
        prefix = f"rng_state.{key}"
        return any(k == prefix or k.startswith(prefix + ".") for k in stored_keys)

    if not stored(own_key) and stored(f"({pp}, {tp})"):
        del rng[own_key]


def restore_own_entry(request, state_dict):
    """After the load: put this rank's own entry under the key load_checkpoint reads; returns a
    warning text when the checkpoint had only the release's shared copy."""
    loaded = state_dict.get("rng_state") if isinstance(state_dict, dict) else None
    if not isinstance(loaded, dict) or fsdp_dtensor_entry(request) is None:
        return None
    pp, tp = fsdp_dtensor_entry(request)
    release_key = f"({pp}, {tp})"
    own_key = own_entry_key(loaded)
    if own_key is not None:
        state_dict["rng_state"] = {release_key: loaded[own_key]}
        return None
    dp_cp = own_entry_key(request).rsplit(",", 1)[1].strip(" )")
    return (
        f"mcore_ckpt_fixes: {ID}: this fsdp_dtensor checkpoint has no RNG state of its own for this rank "
        f"(pp {pp}, tp {tp}, dp_cp {dp_cp}): it was written before rng-under-ep covered fsdp_dtensor (the "
        f"old layout: one shared copy per (pp, tp), its parts written by different data-parallel ranks) "
        f"or with a smaller data-parallel size; this rank restores that shared copy, as an unfixed "
        f"Megatron-Core does; the next save writes every rank's own state"
    )


def _planner_class():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    global _PLANNER
    if _PLANNER is None:

        class RngAwareLoadPlanner(DefaultLoadPlanner):
            """DCP's default load planner that asks for this rank's own RNG entry only where the
            checkpoint has one (see the module docstring)."""

            def set_up_planner(self, state_dict, *args, **kwargs):
                metadata = args[0] if args else kwargs.get("metadata")
                if metadata is not None:
                    drop_absent_own_entry(state_dict, metadata.state_dict_metadata)
                return super().set_up_planner(state_dict, *args, **kwargs)

        _PLANNER = RngAwareLoadPlanner
    return _PLANNER


_PLANNER = None


class DefaultPlannerModule:
    """``torch.distributed.checkpoint.default_planner`` as ``megatron.training.checkpointing`` sees
    it with the fix: the same module, except that its ``DefaultLoadPlanner`` is the RNG-aware one.
    Bound in that module's namespace only; every other user of torch's module is untouched."""

    def __init__(self):
        self.__qualname__ = "DEFAULT_PLANNER"  # what it is named by, for reports of what a fix changed

    def __getattr__(self, name):
        if name == "DefaultLoadPlanner":
            return _planner_class()
        import torch.distributed.checkpoint.default_planner as real

        return getattr(real, name)

    def __repr__(self):
        return "<default_planner as megatron.training.checkpointing sees it (mcore_ckpt_fixes: rng-under-ep)>"


# One instance, marked as this fix's replacement, defined here (where its class is) so that revert
# leaves this definition alone while it restores every binding of it.
DEFAULT_PLANNER = mark(ID)(DefaultPlannerModule())
