"""torch-adam-step's round trips: Megatron's DDP and distributed optimizer on torch's Adam, saved and
loaded with ``dist_checkpointing``, on 2 gloo ranks (DP=2: each rank owns half of every buffer).

A source run: a one-layer GPT (local spec), ``DistributedDataParallel``, ``get_megatron_optimizer``
(Adam, distributed optimizer; on a CPU host without Transformer Engine or Apex Megatron takes
``torch.optim.Adam``), ``STEPS`` real optimizer steps on deterministic gradients, saved with the
case's ``distrib_optim_sharding_type``; then one more step, the reference. A target run (other
initial values) is built ``fresh`` (no step taken: the optimizer has no state) or ``initialised``
(one step taken before the load, as after a warm-up or a failed attempt), asks for its load request
with ``sharded_state_dict(is_loading=True)``, loads and then takes the same next step.

Checked on every rank, in this order: the load request and the load complete (phases
``load_request``, ``load``); every parameter's ``state['step']`` is the checkpoint's (phase ``step``,
one ``AssertionError`` line otherwise), each in a tensor of its own, and torch's param groups hold
what the source run's held (no step: torch's Adam keeps it per parameter); the main-parameter shards, ``exp_avg`` and ``exp_avg_sq``
and the model parameters equal what was saved (``max_delta``); after one more step they equal the
uninterrupted run's (``next/...`` keys of ``max_delta``).

What is not real: the gradients, and on a CPU host the CUDA tensors, as
:mod:`mcore_ckpt_fixes.testing.dist_optimizer` says. The torch's Adam cases run on a GPU too
(``device="cuda"``); the CPU-offload cases use CPU stand-ins of a GPU-side optimizer and run on the CPU only.
"""

from __future__ import annotations

import contextlib
import os

from ....testing.dist_optimizer import (
    SOURCE_SEED,
    build,
    distributed,
    one_case,
    placed,
    request,
    save_request,
    sharding_type,
    step,
    world,
)
from ....testing.offload import build_offloaded, offload_path, offloaded_state

# The scenarios' prepare (warm imports in the parent before any world forks).
from ....testing.dist_optimizer import prepare  # noqa: F401
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 3  # the source run's optimizer steps before the save
TARGET_SEED = 98765
# case -> (distrib_optim_sharding_type, whether the target has taken a step before the load, optimizer)
# optimizer: "adam", torch's Adam (no TE or Apex); "hybrid", HybridDeviceOptimizer (CPU offload) on
# the path Megatron takes with Apex or Transformer Engine installed (as on a GPU host); "hybrid-torch",
# HybridDeviceOptimizer without either.
CASES = {
    "fresh_load": ("dp_reshardable", False, "adam"),
    "stale_step": ("dp_reshardable", True, "adam"),
    "fully_reshardable": ("fully_reshardable", True, "adam"),
    "fresh_fully_reshardable": ("fully_reshardable", False, "adam"),
    "hybrid_stale_step": ("dp_reshardable", True, "hybrid"),
    "hybrid_fresh_load": ("dp_reshardable", False, "hybrid"),
    "hybrid_fully_reshardable": ("fully_reshardable", True, "hybrid"),
    "hybrid_torch_stale_step": ("dp_reshardable", True, "hybrid-torch"),
}


def dp_reshardable_keeps_step():
    """None where ``dp_reshardable`` can save torch Adam's 0-dim per-parameter step (0.16.0 on: it
    is kept out of the bucket tensors), else why the scenario does not run."""
    import inspect

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from ....engine.patching import is_replacement, original

    if sharding_type("dp_reshardable") != "dp_reshardable":
        return None  # before 0.15: the round trip saves in model space, which keeps the step
    # The release's method, not a fix's layer over it (dp-reshardable-padding replaces it).
    method = DistributedOptimizer.__dict__["sharded_param_state_dp_reshardable"]
    if is_replacement(method):
        method = original(DistributedOptimizer, "sharded_param_state_dp_reshardable")
    source = inspect.getsource(method)
    if "'step'" in source or '"step"' in source:
        return None
    return "this release's dp_reshardable has no branch for torch Adam's 0-dim per-parameter step"


def _steps(opt):
    """Every parameter's ``state['step']`` (values), how many distinct tensors hold them, how many parameters."""
    steps = [s.get("step") for d in distributed(opt) for s in d.optimizer.state.values()]
    return sorted({float(t) for t in steps if t is not None}), len({id(t) for t in steps}), len(steps)


def _group_keys(opt):
    """What torch's param groups hold besides their parameters (keys, per optimizer and group)."""
    return [sorted(k for k in g if k != "params") for d in distributed(opt) for g in d.optimizer.param_groups]


@contextlib.contextmanager
def _optimizer_path(kind):
    """Megatron's optimizer modules as the case needs them; for the hybrid optimizer, the CPU
    stand-ins of :mod:`mcore_ckpt_fixes.testing.offload` (yields the device mode, or None)."""
    if kind == "adam":
        import megatron.core.optimizer.distrib_optimizer as do

        assert not do.HAVE_APEX_OR_TE, "Megatron imported a FusedAdam: this round trip needs torch's Adam"
        yield None
        return
    with offload_path(apex=kind == "hybrid") as device:
        yield device


def _build(seed, kind, device):
    """The distributed optimizer on torch's Adam, or with CPU offload (:func:`build_offloaded`)."""
    return build(seed) if kind == "adam" else build_offloaded(seed, device)


def _source(fmt, kind, ckpt_dir, cache, device):
    """Save the source run (once per sharding type and optimizer in a world); return (path, saved
    state, reference, param group keys)."""
    if (fmt, kind) not in cache:
        model, opt = _build(SOURCE_SEED, kind, device)
        for i in range(STEPS):
            step(model, opt, i)
        path = os.path.join(ckpt_dir, f"{kind}-{fmt}")
        save_request(request(model, opt, fmt, False), path)
        saved = offloaded_state(model, opt)
        step(model, opt, STEPS)
        cache[fmt, kind] = (path, saved, offloaded_state(model, opt), _group_keys(opt))
    return cache[fmt, kind]


def _check_steps(rt, opt, group_keys, kind):
    values, tensors, params = _steps(opt)
    rt["steps"] = values
    if values != [float(STEPS)]:
        raise AssertionError(f"per-parameter step after the load: {values}, the checkpoint's: {float(STEPS)}")
    if tensors != params:
        raise AssertionError(f"{params} parameters share {tensors} step tensor(s) after the load")
    # With a FusedAdam importable the release keeps the checkpoint's step in the hybrid optimizer's
    # param groups too (where a FusedAdam counts); its CPU optimizers read their own per-parameter step.
    if kind != "hybrid" and _group_keys(opt) != group_keys:
        raise AssertionError(f"param groups after the load: {_group_keys(opt)}, before the save: {group_keys}")


def run_case(name, ckpt_dir, patched, cache=None):
    """One case (``CASES``) in a world whose parallel state is initialised: its RoundTrip result."""
    from megatron.core import dist_checkpointing

    fmt, initialised, kind = CASES[name]
    fmt = sharding_type(fmt)  # model space before 0.15, which has neither reshardable format
    rt = RoundTrip(case=name, sharding_type=fmt, optimizer=kind, steps=None)
    with rt.running(), _optimizer_path(kind) as device:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        path, saved, reference, group_keys = _source(fmt, kind, ckpt_dir, {} if cache is None else cache, device)
        model, opt = _build(TARGET_SEED, kind, device)
        if initialised:
            step(model, opt, 100)
        rt.phase("load_request")
        wanted = request(model, opt, fmt, True)
        rt.phase("load")
        loaded = dist_checkpointing.load(wanted, path)
        model.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        rt.phase("step")
        _check_steps(rt, opt, group_keys, kind)
        got = offloaded_state(model, opt)
        step(model, opt, STEPS)
        rt.compare(saved, got)
        rt.compare(reference, offloaded_state(model, opt), prefix="next/")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (one source save per sharding type and optimizer): ``{case: result}``."""
    cache, out = {}, {}
    with world(device):
        for name in names or CASES:
            out[name] = placed(run_case(name, ckpt_dir, patched, cache))
    return out


fresh_load = one_case(run_case, "fresh_load")
stale_step = one_case(run_case, "stale_step")
fully_reshardable = one_case(run_case, "fully_reshardable")
hybrid_stale_step = one_case(run_case, "hybrid_stale_step")
