"""mimo-optimizer round trips: a real ``MimoOptimizer`` over real ``DistributedOptimizer``s, non-colocated.

Two modules, ``language`` and ``vision``, each a small real Megatron module (a ColumnParallelLinear
and a RowParallelLinear, TP over the module's own ranks) wrapped in Megatron's
``DistributedDataParallel`` with the distributed optimizer. The modules do not share ranks (the
"non-colocated" MIMO layout): world 2 puts ``language`` on global rank 0 and ``vision`` on rank 1
(TP=1 each); world 4 puts ``language`` on ranks 0-1 and ``vision`` on ranks 2-3 (TP=2 each). Every
rank builds a ``MimoOptimizer`` over both modules' ``ModuleOptimizerInfo`` (its own module active,
the other inactive), exactly as ``get_mimo_optimizer`` lays it out; the inner optimizers are built by
the real ``get_megatron_optimizer`` with the module's process groups.

What is *not* the real thing, and why:

* ``get_mimo_optimizer`` itself is not called: it needs a whole ``MimoModel`` and a ``HyperCommGrid``
  whose API changes between 0.17 and 0.19 (expert views). The ``ProcessGroupCollection`` it would
  derive for the optimizer is built here from plain ``torch.distributed`` groups with the same
  membership. The checkpoint code under test (``MimoOptimizer.sharded_state_dict`` /
  ``load_state_dict`` and the inner optimizers') is the real code.
* On a CPU host the worker's shims (``testing/_cpu_shims.py``) make ``torch.cuda.current_device()``
  the CPU so DDP's buffers and the optimizer's state land there; ``device="cuda"`` puts each module
  on the rank's GPU instead, with no shims. Apex/TransformerEngine are absent, so the
  inner optimizer is ``torch.optim.AdamW`` behind ``DistributedOptimizer`` (its documented fallback).
* The optimizer state is produced by one real AdamW step on the main-parameter shards, then
  overwritten with deterministic per-rank values (and the param groups get seed-dependent lr, betas,
  weight decay and eps, and a step per seed and module: :func:`saved_step`), so a load that returns
  the wrong rank's, the other module's or the fresh optimizer's values cannot pass.

A save is preceded by the same sharding validation ``dist_checkpointing.save`` runs (Megatron's own
``save_preprocess``), with its verdict shared by every rank: Megatron raises that error on global
rank 0 only, and the other ranks would then wait in the save's collectives until the deadline.
A load is preceded likewise by the access validation ``dist_checkpointing.load`` runs.

Each function returns the scenario contract's dict (a
:class:`~mcore_ckpt_fixes.testing.result.RoundTrip` result), with ``error``/``phase`` being the
*world's* first failure (so every rank reports what broke, and ``rank_errors`` says which rank saw
what), plus ``sharding_type`` (what each module's ``DistributedOptimizer`` received on load), ``steps``
(each param group's optimizer step after the load) and ``warnings`` (``MegatronPatchWarning`` texts).
"""

from __future__ import annotations

import contextlib
import warnings
import zlib

import torch
import torch.distributed as dist

from ....testing import placement
from ....testing.compare import max_abs_delta
from ....testing.result import RoundTrip
from ....testing.states import ON, fix_states
from ....testing.world_errors import WorldFailed, shared
from .. import ID, MODULE as TARGET

MODULES = ("language", "vision")
HIDDEN = 16
SAVE_SEED, FRESH_SEED = 1234, 98765
# Sharding types of DistributedOptimizer exercised here (see CPU_SHARDING_TYPES for why not all).
# The non-distributed inner optimizer (Float16OptimizerWithFloat16Params) has no sharding type;
# scenarios take this name in its place.
NON_DISTRIBUTED = "non_distributed"
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter")


# -- CPU shim (worker processes only) -----------------------------------------------------------


def _cuda_to_cpu_mode():
    from ....testing._cpu_shims import cuda_to_cpu_mode

    return cuda_to_cpu_mode()


# -- layout ----------------------------------------------------------------------------------


class RankLayout:
    """Which module each global rank runs and its process groups (every rank creates every group)."""

    def __init__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        assert world in (2, 4), f"mimo_optimizer scenarios need world size 2 or 4, got {world}"
        self.tp = world // 2
        self.module = MODULES[rank // self.tp]
        self.ranks = {m: list(range(i * self.tp, (i + 1) * self.tp)) for i, m in enumerate(MODULES)}
        groups = {m: dist.new_group(r) for m, r in self.ranks.items()}
        alone = [dist.new_group([r]) for r in range(world)][rank]
        from megatron.core.process_groups_config import ProcessGroupCollection

        mine = groups[self.module]
        self.pgs = ProcessGroupCollection(
            tp=mine,
            cp=alone,
            pp=alone,
            dp=alone,
            dp_cp=alone,
            mp=mine,
            tp_cp=mine,
            tp_dp_cp=mine,
            tp_ep_pp=mine,
            expt_dp=alone,
            intra_dist_opt=mine,
            ep=alone,
            expt_tp=mine,
        )
        self.tp_rank = self.pgs.tp.rank()


def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
    )


def _tower_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.module import MegatronModule

    class Tower(MegatronModule):
        """Stands for one MIMO module (language model or encoder): two TP-sharded linears."""

        def __init__(self, config, tp_group, width):
            super().__init__(config)
            self.tp_group = tp_group
            init = torch.nn.init.zeros_
            self.fc1 = ColumnParallelLinear(
                HIDDEN,
                width,
                config=config,
                init_method=init,
                bias=True,
                gather_output=False,
                tp_group=tp_group,
            )
            self.fc2 = RowParallelLinear(
                width,
                HIDDEN,
                config=config,
                init_method=init,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
                tp_group=tp_group,
            )

    return Tower


# Equal widths: both modules' buffers have the same shapes, so only the keys tell them apart (the
# values are drawn per module name and TP rank, see seeded_values: a rank that reads the other module's
# shard gets other numbers and the comparison fails).
_WIDTH = {"language": 32, "vision": 32}
MODEL_PREFIX = {"language": "language_model.", "vision": "modality_submodules.vision."}


def seeded_values(seed, *parts, shape):
    key = "/".join(str(p) for p in (seed,) + parts)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=g, dtype=torch.float32)


class BuiltOptimizer:
    def __init__(self, mimo, model, layout, module_opt):
        self.mimo, self.model, self.layout, self.opt = mimo, model, layout, module_opt

    def model_sharded_state_dict(self):
        return self.model.sharded_state_dict(
            prefix=MODEL_PREFIX[self.layout.module], metadata={"dp_cp_group": self.layout.pgs.dp_cp}
        )


def _build(layout, seed, fmt):
    """A MimoOptimizer over both modules (this rank's one active) with deterministic state."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    name = layout.module
    distributed = fmt != NON_DISTRIBUTED
    model = module_model(layout, distributed)
    with torch.no_grad():
        for pname, p in model.module.named_parameters():
            p.copy_(seeded_values(seed, name, _tp_key(p, layout.tp_rank), "param", pname, shape=p.shape))
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        use_distributed_optimizer=distributed,
        bf16=True,
        fp16=False,
        params_dtype=torch.bfloat16,
    )
    opt = get_megatron_optimizer(opt_config, [model], pg_collection=layout.pgs, use_gloo_process_groups=False)
    _fill_state(opt, seed, name, layout.tp_rank)
    return BuiltOptimizer(mimo_optimizer(layout, opt, opt_config), model, layout, opt)


def module_model(layout, distributed):
    """This rank's module (a :func:`_tower_class` instance, zero-initialised) in Megatron's DDP over
    the module's own process groups."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = _config()
    tower = _tower_class()(config, layout.pgs.tp, _WIDTH[layout.module]).to(placement.device())
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, bucket_size=None)
    return DistributedDataParallel(config, ddp_config, tower, pg_collection=layout.pgs)


def mimo_optimizer(layout, opt, opt_config):
    """The ``MimoOptimizer`` every rank builds, as ``get_mimo_optimizer`` lays it out: both modules'
    ``ModuleOptimizerInfo``, this rank's own module active with ``opt``, the other inactive."""
    from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

    name = layout.module
    infos = {
        m: ModuleOptimizerInfo(
            optimizer=opt if m == name else None,
            grid=None,
            pg_collection=layout.pgs if m == name else None,
            is_active=m == name,
        )
        for m in MODULES
    }
    return MimoOptimizer(infos, opt_config)


def _inner_torch_optimizers(opt):
    chained = getattr(opt, "chained_optimizers", None)
    return [o.optimizer for o in chained] if chained else [opt.optimizer]


def _tp_key(param, tp_rank, per_rank=False):
    """The TP rank a value is drawn for. A TP-replicated parameter (Megatron's rule: no true
    ``tensor_model_parallel`` attribute, e.g. a RowParallelLinear bias) is the same on every TP
    rank, as in training, and a checkpoint keeps one copy of it. ``per_rank``: the values are saved
    per rank whatever they are (a DistributedOptimizer's main-parameter shards, which carry no
    such attribute): drawn per TP rank, so a rank that loads another's cannot pass."""
    return tp_rank if per_rank or getattr(param, "tensor_model_parallel", False) else "replicated"


def saved_step(seed, name):
    """The optimizer step a module's state gets: per module (a rank that loads another module's
    step cannot pass), the same on every rank of the module, as in training."""
    return float(3 + (seed + 5 * MODULES.index(name)) % 17)


def _fill_state(opt, seed, name, tp_rank):
    """One real AdamW step to allocate the state, then deterministic values everywhere."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    distributed = all(isinstance(o, DistributedOptimizer) for o in getattr(opt, "chained_optimizers", None) or [opt])
    for i, torch_opt in enumerate(_inner_torch_optimizers(opt)):
        for g in torch_opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        torch_opt.step()
        for gi, g in enumerate(torch_opt.param_groups):
            g["lr"] = float(seeded_values(seed, name, "lr", i, gi, shape=(1,)).abs().item()) * 1e-3
            g["betas"] = (0.8 + (seed % 7) * 0.01, 0.9 + (seed % 5) * 0.01)
            g["weight_decay"] = 0.01 * (1 + seed % 3) * (gi + 1)
            g["eps"] = 1e-8 * (1 + seed % 11)
            for pi, p in enumerate(g["params"]):
                p.grad = None
                state = torch_opt.state[p]
                for k, t in state.items():
                    if k == "step":
                        state[k] = torch.tensor(saved_step(seed, name), dtype=t.dtype)
                    else:
                        t.copy_(
                            seeded_values(seed, name, _tp_key(p, tp_rank, distributed), i, gi, pi, k, shape=t.shape)
                        )


def _snapshot(opt):
    """Every optimizer state tensor and every param-group field, by position (picklable).

    The step: ``DistributedOptimizer`` checkpoints it as a param-group field (``state_dict()``
    moves the per-parameter ``step`` of torch's Adam there), so it is compared as ``group[i].step``.
    The per-parameter ``step`` tensors are not compared: with torch's Adam (no Apex/TE on CPU) and
    ``dp_reshardable``, ``DistributedOptimizer`` writes the group's step into them and then copies
    the loading optimizer's own non-persistent ``step`` back over it
    (``load_parameter_state_from_dp_reshardable``): an upstream quirk of that fallback, outside
    MIMO, identical with and without this fix.
    """
    out = {"state": {}, "groups": []}
    for i, torch_opt in enumerate(_inner_torch_optimizers(opt)):
        for gi, g in enumerate(torch_opt.param_groups):
            fields = {k: v for k, v in g.items() if k != "params"}
            steps = {float(torch_opt.state[p]["step"]) for p in g["params"] if "step" in torch_opt.state[p]}
            if "step" not in fields and len(steps) == 1:
                fields["step"] = steps.pop()
            fields["step"] = None if fields.get("step") is None else float(fields["step"])
            out["groups"].append(fields)
            for pi, p in enumerate(g["params"]):
                out["state"][f"{i}.{gi}.{pi}.param"] = p.detach().clone()
                for k, t in torch_opt.state[p].items():
                    if k != "step":
                        out["state"][f"{i}.{gi}.{pi}.{k}"] = t.detach().clone()
    return out


def _compare(expected, got):
    """(max |delta| per state tensor, list of param-group fields that differ)."""
    deltas = {}
    for k in sorted(set(expected["state"]) | set(got["state"])):
        a, b = expected["state"].get(k), got["state"].get(k)
        if a is None or b is None:
            deltas[k] = float("inf")
        elif torch.is_tensor(a):
            deltas[k] = max_abs_delta(a, b)  # inf for another shape, 0.0 for empty tensors
        else:
            deltas[k] = 0.0 if a == b else float("inf")
    bad_groups = []
    if len(expected["groups"]) != len(got["groups"]):
        bad_groups.append(f"{len(expected['groups'])} groups saved, {len(got['groups'])} loaded")
    for gi, (a, b) in enumerate(zip(expected["groups"], got["groups"])):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                bad_groups.append(f"group {gi} {k}: saved {a.get(k)!r}, loaded {b.get(k)!r}")
    return deltas, bad_groups


# -- world-level error sharing ----------------------------------------------------------------------


def _metadata(sharding_type):
    return {"distrib_optim_sharding_type": sharding_type}


def _fix_state(patched):
    return fix_states(ID, (TARGET,), patched, accept=ON + ("not-applicable",))


def save_built(built, ckpt_dir, sharding_type):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    def preflight():
        sd = built.mimo.sharded_state_dict(built.model_sharded_state_dict(), metadata=_metadata(sharding_type))
        save_preprocess(sd, validate_access_integrity=True)

    # Every rank builds its state dict first: one that fails there must not leave the others in
    # the validation's collectives.
    shared(
        "sharded_state_dict",
        built.mimo.sharded_state_dict,
        built.model_sharded_state_dict(),
        metadata=_metadata(sharding_type),
    )
    shared("save", preflight)
    sd = shared(
        "sharded_state_dict",
        built.mimo.sharded_state_dict,
        built.model_sharded_state_dict(),
        metadata=_metadata(sharding_type),
    )
    shared("save", dist_checkpointing.save, sd, ckpt_dir)
    dist.barrier()


def load_built(built, ckpt_dir, sharding_type):
    """Load into ``built``; returns (the sharding type each inner optimizer received, warnings)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_sharded_base
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    def preflight():
        # What dist_checkpointing.load does before reading shards, in its order: read the common
        # state, then the access validation (rank 0 raises, the others would go on into torch
        # DCP's collectives and wait there until the deadline).
        dist_checkpointing.load_common_state_dict(ckpt_dir)
        sd = built.mimo.sharded_state_dict(
            built.model_sharded_state_dict(), is_loading=True, metadata=_metadata(sharding_type)
        )
        sd, _, _ = load_preprocess(sd)
        sd, _ = extract_sharded_base(sd)
        validate_sharding_integrity(determine_global_metadata(sd)[1])

    shared("load", preflight)
    sd = shared(
        "sharded_state_dict",
        built.mimo.sharded_state_dict,
        built.model_sharded_state_dict(),
        is_loading=True,
        metadata=_metadata(sharding_type),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = shared("load", dist_checkpointing.load, sd, ckpt_dir)
        shared("load_state_dict", built.mimo.load_state_dict, loaded)
    from mcore_ckpt_fixes.engine.errors import MegatronPatchWarning

    got = loaded.get(built.layout.module) or {}
    # The monkeypatch warns with MegatronPatchWarning; a source-patched Megatron (patches/) with
    # a plain UserWarning carrying the same text after the "mcore_ckpt_fixes: <fix>: " prefix.
    return got.get("param_state_sharding_type"), sorted(
        {
            str(w.message)
            for w in caught
            if issubclass(w.category, MegatronPatchWarning) or "holds the MIMO optimizer state" in str(w.message)
        }
    )


def _round_trip():
    """This rank's :class:`RoundTrip` with the fields every mimo-optimizer scenario reports.

    A world failure (:class:`WorldFailed`) is recorded as the world's first error (see
    :func:`_record_world_failure`); anything else raised on this rank, outside a collective step, is
    recorded by the RoundTrip in phase ``setup`` (the only phase set here: the steps name theirs)."""
    rt = RoundTrip(
        rank_errors=None,
        bad_groups=[],
        device=None,
        module=None,
        tp_rank=None,
        sharding_type=None,
        warnings=[],
        steps=None,
    )
    rt.phase("setup")
    return rt


def _record_world_failure(rt, failed):
    """The world's first failure, the same on every rank; ``traceback`` only where this rank raised it."""
    rt.fail(failed.error, phase=failed.phase)
    rt["rank_errors"] = failed.rank_errors
    if failed.traceback:
        rt["traceback"] = failed.traceback


def _check_loaded(rt, built, sharding_type, loaded_type):
    expected = _snapshot(_build(built.layout, SAVE_SEED, sharding_type).opt)
    got = _snapshot(built.opt)
    deltas, bad_groups = _compare(expected, got)
    rt["max_delta"], rt["bad_groups"], rt["n_tensors"] = deltas, bad_groups, len(deltas)
    rt["steps"] = [g.get("step") for g in got["groups"]]  # what each param group's step loaded as
    rt["sharding_type"] = loaded_type
    problems = [f"{k}: {d}" for k, d in deltas.items() if d != 0.0] + bad_groups
    if loaded_type != (None if sharding_type == NON_DISTRIBUTED else sharding_type):
        problems.append(f"sharding type saved {sharding_type!r}, loaded {loaded_type!r}")
    return problems


# -- scenarios -----------------------------------------------------------------------------------


def save_side_applicable():
    """None where ``world2`` shows its bug with the fix off (0.17/0.18), else why it is not run."""
    from ....engine.version import detect
    from packaging.specifiers import SpecifierSet

    from .scenarios import MIMO_SAVE_SIDE

    version = detect().version
    if version is not None and version not in SpecifierSet(MIMO_SAVE_SIDE, prereleases=True):
        return (
            f"Megatron-Core {version} writes this per-module layout itself (no fix-off failure to show "
            f"here: only {MIMO_SAVE_SIDE}); this release's MIMO bug is torch_adam's"
        )
    return None


def prepare() -> None:
    """Import what the worlds need once in the parent, so every forked world starts warm."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    try:
        import megatron.core.models.mimo.optimizer  # noqa: F401
    except ImportError:
        pass  # 0.16 has no MimoOptimizer: the scenarios report not-applicable there


def _scenario(body, patched, device):
    rt = _round_trip()
    on_cpu = device == "cpu" and not torch.cuda.is_available()
    with placement.on(device), _cuda_to_cpu_mode() if on_cpu else contextlib.nullcontext(), rt.running():
        rt["device"] = str(placement.device())
        try:
            layout = RankLayout()
            rt["module"], rt["tp_rank"] = layout.module, layout.tp_rank
            rt["fix_state"] = _fix_state(patched)
            body(layout, rt)
        except WorldFailed as failed:
            _record_world_failure(rt, failed)
    return rt.result


def _own_type(sharding_type, layout):
    """The inner optimizer type of this rank's module: ``sharding_type`` is one type for every
    module, or a ``{module: type}`` dict (modules may differ, e.g. a non-distributed optimizer for
    one and a DistributedOptimizer for the other)."""
    return sharding_type[layout.module] if isinstance(sharding_type, dict) else sharding_type


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu", sharding_type="dp_reshardable"):
    """Save with one MimoOptimizer, load into a fresh one with other values, compare everything."""

    def body(layout, rt):
        own = _own_type(sharding_type, layout)
        saved = _build(layout, SAVE_SEED, own)
        fresh = _build(layout, FRESH_SEED, own)
        assert _compare(_snapshot(saved.opt), _snapshot(fresh.opt))[1], "fresh param groups equal the saved ones"
        save_built(saved, ckpt_dir, own)
        _load_and_check(layout, rt, fresh, ckpt_dir, own)

    return _scenario(body, patched, device)


def torch_adam(rank, world_size, ckpt_dir, patched, device="cpu"):
    """:func:`round_trip` with every module on Megatron's non-distributed optimizer over torch's
    AdamW (``Float16OptimizerWithFloat16Params``, bf16, as Megatron builds it without TE/Apex),
    which keeps the step shared by all parameters as plain common state: defect (e)."""
    return round_trip(rank, world_size, ckpt_dir, patched, device, sharding_type=NON_DISTRIBUTED)


def save_only(rank, world_size, ckpt_dir, patched, device="cpu", sharding_type="dp_reshardable"):
    """The save half of :func:`round_trip` (cross-release matrix: another environment loads)."""

    def body(layout, rt):
        own = _own_type(sharding_type, layout)
        save_built(_build(layout, SAVE_SEED, own), ckpt_dir, own)

    return _scenario(body, patched, device)


def load_only(rank, world_size, ckpt_dir, patched, device="cpu", sharding_type="dp_reshardable"):
    """The load half of :func:`round_trip`, on a checkpoint another environment wrote."""

    def body(layout, rt):
        own = _own_type(sharding_type, layout)
        _load_and_check(layout, rt, _build(layout, FRESH_SEED, own), ckpt_dir, own)

    return _scenario(body, patched, device)


def _load_and_check(layout, rt, fresh, ckpt_dir, sharding_type):
    loaded_type, rt["warnings"] = load_built(fresh, ckpt_dir, sharding_type)
    problems = _check_loaded(rt, fresh, sharding_type, loaded_type)
    shared("compare", _raise_if, problems)


def _raise_if(problems):
    if problems:
        raise AssertionError(f"loaded state differs from the saved one: {problems[:6]}")
