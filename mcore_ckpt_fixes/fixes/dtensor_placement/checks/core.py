"""dtensor-placement round trips: real Megatron-Core layers whose parameters are torch FSDP2 DTensors.

Every model is a real Megatron-Core module built from an explicit ``ProcessGroupCollection``
(``parallel_state`` stays uninitialised), given deterministic values, then sharded with torch's own
``fully_shard`` on a CPU ``DeviceMesh`` (gloo), the way Megatron's ``TorchFullyShardedDataParallel``
does it (its custom parameter attributes saved and restored around ``fully_shard``, each parameter
tagged ``is_torch_fsdp2_param``; the wrapper itself hard-codes a CUDA mesh, so it is not called).
It is saved with ``dist_checkpointing.save`` and loaded with ``dist_checkpointing.load`` into a fresh
model with other values; every rank must get back exactly its own local shards.

* ``moe_ep`` (world 4, EP=2, dense DP=4, expert DP=2): a ``MoELayer`` with local ``SequentialMLP``
  experts (2 per EP rank); each expert ``fully_shard``-ed Shard(0) over its expert-DP mesh
  ({0,2} / {1,3}), then the layer itself (so the router) over the dense DP mesh (all 4 ranks).
* ``hsdp`` (world 4, HSDP mesh 2 replicate x 2 shard, dense DP=4): a dense ``MLP``; loaded back into
  the same layout and into an unsharded copy of the layer (full tensors, no FSDP), which reads the
  checkpoint's global shapes as any other layout would.
* ``tp_fsdp`` (world 2, TP=2, FSDP2 over the data-parallel mesh of size 1, sharding the TP axis'
  dimension 0 again): the layout upstream already handles; exact with and without the fix.

Validation (phase ``validate``): before saving, Megatron's own ``validate_sharding_integrity`` runs
on rank 0 (as inside ``dist_checkpointing.save``) on each key's global metadata, and its verdict is
broadcast, so every rank reports the same failure instead of the other ranks waiting in the save's
collectives until the deadline. The error line is ``CheckpointingException: Invalid access pattern
for <keys>``: the exception type and the keys Megatron rejected. Megatron's own messages embed
whole ShardedTensor reprs and differ between releases (0.16 stops at the first key); they are kept
in ``raw_error``. A load that torch DCP aborts reports the first Megatron ``CheckpointingException``
line DCP wrapped (DCP's own message concatenates every rank's traceback).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ....testing.compare import max_abs_delta
from ....testing.meshes import cpu_mesh as _mesh
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import EXPERTS as _EXPERTS_MODULE
from .. import ID as FIX_ID
from .. import UTILS as _UTILS_MODULE

SAVE_SEED, FRESH_SEED = 1234, 98765
HIDDEN, FFN, EXPERTS = 8, 12, 4
_TARGETS = (_UTILS_MODULE, _EXPERTS_MODULE)


def prepare() -> None:
    import torch.distributed.fsdp  # noqa: F401

    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.transformer.mlp  # noqa: F401
    import megatron.core.transformer.moe.moe_layer  # noqa: F401


# -- groups ----------------------------------------------------------------------------------------


def _new_groups(rank_lists):
    """Every rank creates every group in the same order; returns the one holding this rank."""
    me = dist.get_rank()
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if me in ranks:
            mine = g
    return mine


def _pgs(tp, ep):
    """A ProcessGroupCollection in Megatron's default order (tp-cp-ep-dp, PP=CP=1)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    dp = world // tp
    ranks = list(range(world))
    tp_groups = [ranks[i : i + tp] for i in range(0, world, tp)]
    dp_groups = [ranks[i::tp] for i in range(tp)]
    # Experts: expert TP = 1; EP inner, expert DP outer.
    ep_groups = [ranks[i : i + ep] for i in range(0, world, ep)]
    edp_groups = [ranks[i::ep] for i in range(ep)]
    alone = [[r] for r in ranks]
    pgs = ProcessGroupCollection()
    pgs.tp = _new_groups(tp_groups)
    pgs.dp = pgs.dp_cp = _new_groups(dp_groups)
    everyone = _new_groups([ranks])
    single = _new_groups(alone)
    pgs.cp, pgs.pp, pgs.expt_tp = single, single, single
    pgs.tp_cp = pgs.mp = pgs.tp
    pgs.tp_dp_cp = everyone
    pgs.ep = pgs.tp_ep = pgs.tp_ep_pp = _new_groups(ep_groups)
    pgs.expt_dp = _new_groups(edp_groups)
    meshes = {
        "dp": (dp_groups, pgs.dp),
        "edp": (edp_groups, pgs.expt_dp),
    }
    return pgs, meshes, dp


def _config(tp=1, **extra):
    """Linear layers with biases; MoE layers without them on 0.12.1-0.14, which refuse
    ("Bias is not supported for MoE")."""
    from megatron.core.transformer import TransformerConfig

    def make(bias):
        return TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=2,
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
            add_bias_linear=bias,
            **extra,
        )

    try:
        return make(True)
    except AssertionError as exc:
        if "Bias is not supported for MoE" not in str(exc):
            raise
        return make(False)


# -- values, FSDP2 ---------------------------------------------------------------------------------


def _fill(named_params, seed, tag):
    """Deterministic values: ``tag(name, param)`` says what identifies the tensor's content (TP
    rank, global expert index), so ranks holding the same tensor agree and others differ."""
    with torch.no_grad():
        for name, p in named_params:
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{tag(name, p)}/{name}".encode()))
            p.copy_(torch.randn(p.shape, generator=g))


def fully_shard_like_megatron(module, mesh):
    """``fully_shard`` with Megatron's TorchFullyShardedDataParallel attribute handling: FSDP2
    replaces the parameters, so their Megatron attributes are saved and set again, plus the
    ``is_torch_fsdp2_param`` tag that wrapper adds."""
    from torch.distributed.fsdp import fully_shard

    attrs = {n: dict(vars(p), is_torch_fsdp2_param=True) for n, p in module.named_parameters()}
    fully_shard(module, mesh=mesh)
    for n, p in module.named_parameters():
        for k, v in attrs.get(n, {}).items():
            setattr(p, k, v)
    return module


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _local_tensors(model):
    return {k: _local(v).detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _fix_state(patched):
    import megatron.core.transformer.moe.experts  # noqa: F401  (both targets decided)
    import megatron.core.utils  # noqa: F401

    return fix_states(FIX_ID, _TARGETS, patched)


def validate(sharded_sd):
    """Megatron's validation of the global sharding, run on rank 0 key by key; verdict broadcast."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    _, global_md = determine_global_metadata(sharded_sd)
    verdict = [None]
    if dist.get_rank() == 0:
        keys = sorted({sh.key for md in global_md for sh in md if isinstance(sh, ShardedTensor)})
        bad, raw = [], []
        for key in keys:
            try:
                validate_sharding_integrity([[sh for sh in md if sh.key == key] for md in global_md])
            except Exception as exc:  # Megatron's CheckpointingException or its shape AssertionError
                kind = "Invalid access pattern" if "Invalid access pattern" in str(exc) else type(exc).__name__
                bad.append((key, kind))
                raw.append(f"{type(exc).__name__}: {exc}")
        if bad:
            kinds = sorted({k for _, k in bad})
            verdict = [
                (f"CheckpointingException: {' / '.join(kinds)} for " + ", ".join(k for k, _ in bad), "\n".join(raw))
            ]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


class ValidationFailed(Exception):
    """Megatron's validation rejected the sharding (its one-line verdict is the message)."""


_CKPT_EXC = "megatron.core.dist_checkpointing.core.CheckpointingException: "


def _error_line(exc):
    """``Type: message``; for torch DCP's CheckpointException, which wraps every rank's traceback,
    the first Megatron CheckpointingException line inside it (the full text stays in raw_error)."""
    if isinstance(exc, ValidationFailed):
        return str(exc)
    text = str(exc)
    for line in text.splitlines():
        if line.startswith(_CKPT_EXC):
            return "CheckpointingException: " + line[len(_CKPT_EXC) :]
    return f"{type(exc).__name__}: {text}"


def _save(rt, build, ckpt_dir, metadata):
    """Build, validate and save the model of seed SAVE_SEED; returns its local tensors. A sharding
    Megatron rejects stops here with one line (``raw_error``: Megatron's own messages)."""
    from megatron.core import dist_checkpointing

    rt.phase("build")
    saved = build(SAVE_SEED)
    before = _local_tensors(saved)
    rt.phase("sharded_state_dict")
    sd = saved.sharded_state_dict(prefix="", metadata=metadata)
    rt.phase("validate")
    failed = validate(sd)
    if failed is not None:
        rt["raw_error"] = failed[1]
        raise ValidationFailed(failed[0])
    rt.phase("save")
    dist_checkpointing.save(sd, ckpt_dir)
    dist.barrier()
    return before


def _load_in_place(rt, build, ckpt_dir, metadata, before):
    """Load into a fresh model of the same layout (other values); returns max delta per tensor."""
    from megatron.core import dist_checkpointing

    rt.phase("build_fresh")
    fresh = build(FRESH_SEED)
    assert not any(torch.equal(t, _local_tensors(fresh)[k]) for k, t in before.items() if t.numel()), "vacuous"
    rt.phase("load")
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(prefix="", metadata=metadata), ckpt_dir)
    deltas = {}
    for k, want in before.items():
        got = loaded[k]
        _local(fresh.state_dict()[k]).data.copy_(got)  # what load_state_dict does for FSDP2
        deltas[k] = max_abs_delta(want, got)
    return deltas


def _round_trip(build, patched, ckpt_dir, metadata, reference=None):
    """build(seed) -> FSDP2-sharded model. ``reference``: (build_plain(seed), full tensors) loaded
    from the same checkpoint after the same-layout check."""
    from megatron.core import dist_checkpointing

    rt = RoundTrip(error_line=_error_line, raw_error=None)
    validation_raw = None
    with rt.running():  # records DCP's CheckpointException too (a BaseException)
        rt.phase("precondition")
        rt["fix_state"] = _fix_state(patched)
        try:
            before = _save(rt, build, ckpt_dir, metadata)
        except ValidationFailed:
            validation_raw = rt["raw_error"]  # Megatron's messages, not the one line
            raise
        deltas = _load_in_place(rt, build, ckpt_dir, metadata, before)
        rt["max_delta"] = dict(sorted(deltas.items()))  # the same-layout half, kept if what follows fails
        if reference is not None:
            build_plain, full = reference
            rt.phase("load_unsharded")
            plain = build_plain(FRESH_SEED)
            got = dist_checkpointing.load(plain.sharded_state_dict(prefix="", metadata=metadata), ckpt_dir)
            for k, want in full.items():
                deltas[f"unsharded/{k}"] = max_abs_delta(want, got[k])
        rt.phase("compare")
        rt["n_tensors"] = len(deltas)
        rt["max_delta"] = dict(sorted(deltas.items()))
        bad = rt.differing()
        assert not bad, f"tensors differ after load: {bad}"
    if validation_raw is not None:  # record() wrote the one line there; Megatron's own text is kept
        rt["raw_error"] = validation_raw
    return rt.result


# -- scenarios -------------------------------------------------------------------------------------


def moe_ep(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """MoELayer, EP=2 x expert-DP=2 experts (FSDP2 over expert DP), router FSDP2 over dense DP=4."""
    assert device == "cpu", "dtensor-placement scenarios run on CPU/gloo"
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    assert world_size == 4
    config = _config(num_moe_experts=EXPERTS, moe_ffn_hidden_size=FFN, expert_model_parallel_size=2)
    submodules = _submodules(get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False).submodules.mlp)
    if helpers_read_parallel_state():  # 0.12-0.15: modules and helpers take their groups from parallel_state
        ps = _initialize_parallel_state(tp=1, ep=2)
        dense, expert_dp, ep_rank, layer_kwargs, metadata = (
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_data_parallel_group(),
            ps.get_expert_model_parallel_rank(),
            {},
            None,
        )
    else:
        pgs, _, _ = _pgs(tp=1, ep=2)
        dense, expert_dp, ep_rank = pgs.dp_cp, pgs.expt_dp, pgs.ep.rank()
        layer_kwargs, metadata = {"pg_collection": pgs}, {"dp_cp_group": pgs.dp_cp}
    dense_mesh, expert_mesh = _mesh(dense), _mesh(expert_dp)
    n_local = EXPERTS // 2

    def build(seed):
        layer = MoELayer(config, submodules, **layer_kwargs)
        _fill(layer.router.named_parameters(), seed, lambda n, p: "router")
        for i, expert in enumerate(layer.experts.local_experts):
            _fill(expert.named_parameters(), seed, lambda n, p, e=ep_rank * n_local + i: f"expert{e}")
            fully_shard_like_megatron(expert, expert_mesh)
        # The root takes what the experts left: the router (TopKRouter's own class cannot be swapped
        # by fully_shard; Megatron's wrapper shards the root last as well).
        return fully_shard_like_megatron(layer, dense_mesh)

    return _round_trip(build, patched, ckpt_dir, metadata)


def _submodules(spec):
    """A layer spec's submodules: a ModuleSpec up to 0.17, a functools.partial from 0.18."""
    found = getattr(spec, "submodules", None)
    return found if found is not None else spec.keywords["submodules"]


def _mlp(config, pgs):
    """A dense MLP; ``pgs`` None: its TP group from parallel_state (0.12-0.15)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    kwargs = {} if pgs is None else {"tp_group": pgs.tp}
    return MLP(config, _submodules(get_gpt_layer_local_spec().submodules.mlp), **kwargs)


def hsdp(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """A dense MLP under HSDP (2 replicate x 2 shard) on a dense DP group of 4."""
    assert device == "cpu", "dtensor-placement scenarios run on CPU/gloo"
    from torch.distributed.device_mesh import init_device_mesh

    assert world_size == 4
    if helpers_read_parallel_state():
        _initialize_parallel_state(tp=1, ep=1)
        pgs, metadata = None, None
    else:
        pgs, _, _ = _pgs(tp=1, ep=1)
        metadata = {"dp_cp_group": pgs.dp_cp}
    config = _config()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build_plain(seed):
        mlp = _mlp(config, pgs)
        _fill(mlp.named_parameters(), seed, lambda n, p: "dense")
        return mlp

    def build(seed):
        return fully_shard_like_megatron(build_plain(seed), mesh)

    full = _local_tensors(build_plain(SAVE_SEED))
    return _round_trip(build, patched, ckpt_dir, metadata, reference=(build_plain, full))


def tp_fsdp(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """A dense MLP with TP=2 and FSDP2 over the data-parallel mesh (size 1 in a world of 2)."""
    assert device == "cpu", "dtensor-placement scenarios run on CPU/gloo"
    assert world_size == 2
    if helpers_read_parallel_state():
        ps = _initialize_parallel_state(tp=2, ep=1)
        pgs, dense, tp_rank, metadata = (
            None,
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_tensor_model_parallel_rank(),
            None,
        )
    else:
        pgs, _, _ = _pgs(tp=2, ep=1)
        dense, tp_rank, metadata = pgs.dp_cp, pgs.tp.rank(), {"dp_cp_group": pgs.dp_cp}
    config = _config(tp=2)
    mesh = _mesh(dense)

    def build(seed):
        mlp = _mlp(config, pgs)
        _fill(mlp.named_parameters(), seed, lambda n, p: tp_rank if getattr(p, "tensor_model_parallel", False) else -1)
        return fully_shard_like_megatron(mlp, mesh)

    return _round_trip(build, patched, ckpt_dir, metadata)


# -- the seed case as a user's own script writes it ------------------------------------------------

# (parameter name = checkpoint key, Megatron helper, placement on the size-1 expert-DP mesh)
HELPER_CASES = (
    ("expert_make_sharded_replicate", "make_sharded_tensor_for_checkpoint", "replicate"),
    ("expert_make_sharded_shard0", "make_sharded_tensor_for_checkpoint", "shard0"),
    ("expert_make_tp_sharded_replicate", "make_tp_sharded_tensor_for_checkpoint", "replicate"),
    ("expert_make_tp_sharded_shard0", "make_tp_sharded_tensor_for_checkpoint", "shard0"),
)


class _ExpertsThroughHelpers(torch.nn.Module):
    """One expert weight per EP rank per case, a DTensor on this rank's size-1 expert-DP mesh
    (tagged as Megatron's FSDP2 wrapper tags its parameters), described by calling Megatron's
    helpers directly with the expert's global index prepended and the *dense* DP group passed in."""

    def __init__(self, mesh, ep_rank, dense_group, seed):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        super().__init__()
        self.ep_rank, self.dense_group = ep_rank, dense_group
        for name, _, place in HELPER_CASES:
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/expert{ep_rank}/{name}".encode()))
            placement = Shard(0) if place == "shard0" else Replicate()
            dt = DTensor.from_local(torch.randn(4, 3, generator=g), mesh, [placement], run_check=False)
            param = torch.nn.Parameter(dt, requires_grad=False)
            param.is_torch_fsdp2_param = True
            self.register_parameter(name, param)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        import sys

        utils = sys.modules["megatron.core.utils"]  # the binding the fix replaces
        expert = ((0, self.ep_rank, 2),)
        # 0.12-0.15 helpers take no groups: they read the same dense group from parallel_state.
        groups = {} if self.dense_group is None else {"dp_cp_group": self.dense_group}
        out = {}
        for name, helper, _ in HELPER_CASES:
            param = getattr(self, name)
            if helper == "make_tp_sharded_tensor_for_checkpoint":
                out[name] = utils.make_tp_sharded_tensor_for_checkpoint(
                    param, name, tp_axis=0, prepend_offsets=expert, **groups
                )
            else:
                out[name] = utils.make_sharded_tensor_for_checkpoint(param, name, prepend_offsets=expert, **groups)
        return out


def helpers_read_parallel_state() -> bool:
    """0.12-0.15: Megatron's helpers take no group arguments; they read parallel_state."""
    import megatron.core.utils as mu

    from ....engine.patching import original
    from ..runtime.core import TP_HELPER, takes_groups

    return not takes_groups(original(mu, TP_HELPER))


def _initialize_parallel_state(tp, ep):
    """Megatron's own groups (default backend: gloo here), for releases whose modules read them."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    return parallel_state


def ep2_helpers(rank: int, world_size: int, ckpt_dir: str, patched: bool, device: str = "cpu") -> dict:
    """EP=2 on 2 ranks (expert DP 1): each rank's expert weights through both helpers, Shard(0) and
    Replicate on the size-1 expert-DP mesh, the dense DP group (size 2) handed in; dist_checkpointing."""
    assert device == "cpu", "dtensor-placement scenarios run on CPU/gloo"
    assert world_size == 2
    if helpers_read_parallel_state():
        ps = _initialize_parallel_state(tp=1, ep=2)
        expert_mesh, ep_rank, dense = (
            _mesh(ps.get_expert_data_parallel_group()),
            ps.get_expert_model_parallel_rank(),
            None,
        )
        assert ps.get_data_parallel_world_size() == 2
    else:
        pgs, _, _ = _pgs(tp=1, ep=2)
        expert_mesh, ep_rank, dense = _mesh(pgs.expt_dp), pgs.ep.rank(), pgs.dp_cp
        assert pgs.dp_cp.size() == 2
    assert expert_mesh.size() == 1

    def build(seed):
        return _ExpertsThroughHelpers(expert_mesh, ep_rank, dense, seed)

    return _round_trip(build, patched, ckpt_dir, None)
