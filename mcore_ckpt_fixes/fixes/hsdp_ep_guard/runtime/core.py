"""hsdp-ep-guard's monkeypatch: the probe (the release's own ``_init_dist_index`` on inert stand-ins)
and ``_init_dist_index`` with the guard in front. Imported only when the adapter module is; the
declaration and why are in the package's docstring (:mod:`mcore_ckpt_fixes.fixes.hsdp_ep_guard`).
"""

from __future__ import annotations

import types

from ....engine.layers import layer
from ....engine.patching import is_replacement, original
from ....engine.probing import Group, in_scope, module_scope
from .. import ID, MODULE

CLASS = "FullyShardedDataParallel"


def refusal(instances, ep_size):
    """The guard's message (one line; the source diff, ``diff/core.py``, raises the same text)."""
    return (
        f"Megatron-FSDP with num_distributed_optimizer_instances={instances} (HSDP) and "
        f"expert_model_parallel_size={ep_size} is not supported by this Megatron-Core: it would shard "
        f"the expert parameters on the dense data-parallel mesh. Accepted: "
        f"num_distributed_optimizer_instances=1 with expert parallelism, or expert_model_parallel_size=1 "
        f"with HSDP (Megatron-Core >= 0.17 supports both together)"
    )


def _ep_size(pg_collection):
    if pg_collection is not None:
        group = getattr(pg_collection, "ep", None)
        return group.size() if group is not None else 1
    from megatron.core import parallel_state

    return max(parallel_state.get_expert_model_parallel_world_size(), 1)  # 0 when uninitialised


@layer(ID, MODULE, "_init_dist_index", owner=CLASS)
def init_dist_index(below_us, self, pg_collection):
    """``FullyShardedDataParallel._init_dist_index`` with the HSDP x EP guard in front."""
    instances = getattr(self.ddp_config, "num_distributed_optimizer_instances", 1) or 1
    if instances > 1:
        ep_size = _ep_size(pg_collection)
        if ep_size > 1:
            raise ValueError(refusal(instances, ep_size))
    return below_us(self, pg_collection)


# -- probe: the release's own _init_dist_index on inert stand-ins ------------------------------------


class _ProbeDone(Exception):
    pass


def hsdp_ep_behaviour(module):
    """What the release's own ``_init_dist_index`` does with HSDP (2 instances) and EP = 2:
    ``"dense-mesh"`` (no expert mesh: the bug), ``"expert-mesh"`` (0.17+), ``"refused"`` (a guard,
    e.g. patches/hsdp-ep-guard/), or None when the adapter has no such method.

    Runs it with stand-ins for the process groups, the mesh helpers, ``DeviceMesh`` and
    ``FSDPDistributedIndex`` in a copy of the module's globals (the live module is left as it is):
    nothing is built.
    """
    cls = module.__dict__.get(CLASS)
    fn = getattr(cls, "__dict__", {}).get("_init_dist_index")
    if fn is None:
        return None
    if is_replacement(fn):
        fn = original(cls, "_init_dist_index")
    import numpy as np

    seen = {}

    def index(**kwargs):
        seen.update(kwargs)
        raise _ProbeDone

    class _Mesh:
        @staticmethod
        def from_group(*args, **kwargs):
            return object()

    two, one = Group(size=2), Group(size=1)
    pgs = types.SimpleNamespace(
        tp=one, expt_tp=one, intra_dp_cp=one, inter_dist_opt=two, dp_cp=two, ep=two, expt_dp=one, intra_expt_dp=one
    )
    fake = {
        "FSDPDistributedIndex": index,
        "DeviceMesh": _Mesh,
        "_get_hsdp_tp_mesh": lambda *a, **k: np.zeros((2, 1, 1), dtype=int),
        "_get_dp_tp_mesh": lambda *a, **k: np.zeros((1, 1), dtype=int),
    }
    run = in_scope(fn, module_scope(module, **fake))  # a copy of the module's globals: the live one is left as it is
    wrapper = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="no_shard"),
        num_moe_experts=4,
    )
    try:
        run(wrapper, pgs)
    except _ProbeDone:
        pass
    except ValueError as exc:
        if "expert_model_parallel_size" in str(exc) and "num_distributed_optimizer_instances" in str(exc):
            return "refused"
        raise
    if not seen:
        raise RuntimeError("_init_dist_index returned without building an FSDPDistributedIndex")
    return "expert-mesh" if seen.get("expt_device_mesh") is not None else "dense-mesh"


def probe(module: types.ModuleType):
    behaviour = hsdp_ep_behaviour(module)
    if behaviour is None:
        return None, f"{MODULE} has no {CLASS}._init_dist_index (Megatron-FSDP adapter absent)"
    if behaviour == "dense-mesh":
        return True, "HSDP with EP > 1 builds no expert mesh: experts are sharded on the dense data-parallel mesh"
    if behaviour == "refused":
        return False, "HSDP with EP > 1 is refused at setup"
    return False, "HSDP with EP > 1 gets its own expert mesh"
