"""hybrid-optimizer-gpu-step's round trips on 2 gloo ranks (DP=2): Megatron's DDP and distributed
optimizer with ``optimizer_cpu_offload`` and the precision-aware optimizer (as Megatron-LM requires
it). ``partial_offload``: ``optimizer_offload_fraction=0.5``, the hybrid optimizer steps half of the
parameters with a GPU FusedAdam (Apex's, on the path a GPU host takes), half with CPU AdamW.
``gpu_only``: fraction 0, every parameter on the GPU FusedAdam, no CPU optimizer.

A source run takes ``STEPS`` steps on deterministic gradients, saves ``fully_reshardable`` with
``dist_checkpointing``, then takes two more (the reference). A target run (other initial values)
loads the checkpoint as Megatron does (``sharded_state_dict(is_loading=True)``, the model's and the
optimizer's ``load_state_dict``) and takes the same two steps. Checked on every rank: the GPU
FusedAdam's group ``step`` after them against the reference's (phase ``steps``: one
``AssertionError`` line where they differ), then the model, main shards, Adam moments and the CPU
optimizers' copies after each step against the reference's (``next1/``, ``next2/``).

What is not real on a CPU host: the GPU (:mod:`mcore_ckpt_fixes.testing.offload`: the parameters and
the fp32 copies made of them report ``is_cuda``), Apex's FusedAdam (a stand-in with its interface,
which keeps its step in its param groups as Apex's and Transformer Engine's do) and the gradients.
"""

from __future__ import annotations

import os

from ....testing.dist_optimizer import (
    SOURCE_SEED,
    distributed,
    one_case,
    request,
    run_cases,
    save_request,
    sharding_type,
    step,
)
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.offload import build_offload_fraction, deriving, load_offloaded, offload_path, stepped_states
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import DIST_MODULE, ID, MODULE

STEPS = 3  # the source run's steps before the save
NEXT = (STEPS, STEPS + 1)  # the two steps after it, of the reference and of the resumed run
TARGET_SEED = 98765
# fully_reshardable; before 0.15 (which has none) the model-space format.
PREFERRED_FORMAT = "fully_reshardable"
FRACTIONS = {"partial_offload": 0.5, "gpu_only": 0.0}  # case -> --optimizer-offload-fraction
CASES = tuple(FRACTIONS)


def gpu_steps(opt) -> list:
    """The step in each param group of the hybrid optimizers' GPU FusedAdams (None: no step yet)."""
    out = []
    for d in distributed(opt):
        gpu = getattr(d.optimizer, "gpu_optimizer", None)
        out += [group.get("step") for group in gpu.param_groups] if gpu is not None else []
    return out


def _source(name, ckpt_dir, cache, device):
    if name not in cache:
        model, opt = build_offload_fraction(SOURCE_SEED, device, FRACTIONS[name])
        with deriving(device):
            for i in range(STEPS):
                step(model, opt, i)
        path = os.path.join(ckpt_dir, f"{name}-{sharding_type(PREFERRED_FORMAT)}")
        save_request(request(model, opt, sharding_type(PREFERRED_FORMAT), False), path)
        cache[name] = (path, stepped_states(model, opt, device, NEXT), gpu_steps(opt))
    return cache[name]


def run_case(name, ckpt_dir, patched, cache=None):
    rt = RoundTrip(case=name, gpu_steps=None, reference_gpu_steps=None)
    with rt.running(), offload_path(apex=True) as device:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE, DIST_MODULE), patched)
        rt.phase("save")
        path, reference, rt["reference_gpu_steps"] = _source(name, ckpt_dir, {} if cache is None else cache, device)
        model, opt = build_offload_fraction(TARGET_SEED, device, FRACTIONS[name])
        rt.phase("load")
        load_offloaded(model, opt, path, sharding_type(PREFERRED_FORMAT), device)
        got = stepped_states(model, opt, device, NEXT)
        rt.phase("steps")
        rt["gpu_steps"] = gpu_steps(opt)
        if rt["gpu_steps"] != rt["reference_gpu_steps"]:
            raise AssertionError(
                f"the GPU FusedAdam's step after two resumed steps is {rt['gpu_steps']}, "
                f"the uninterrupted run's {rt['reference_gpu_steps']}"
            )
        rt.phase("compare")
        for i, (want, have) in enumerate(zip(reference, got), start=1):
            rt.compare(want, have, prefix=f"next{i}/")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """The cases in one world (one source save): ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched, device)


partial_offload = one_case(run_case, "partial_offload")
gpu_only = one_case(run_case, "gpu_only")
