"""hybrid-optimizer-chained-step's round trips on one gloo rank: a one-layer bf16 GPT under Megatron's
DDP and distributed optimizer with ``optimizer_cpu_offload`` and the precision-aware optimizer, its
MLP weights kept out of the dense all-reduce (``allreduce=False``, as Megatron marks experts under
EP), so that Megatron chains a dense and an expert optimizer, each over a ``HybridDeviceOptimizer``.
``full_offload``: ``optimizer_offload_fraction=1.0`` (CPU AdamW only); ``partial_offload``: 0.5 (a
GPU FusedAdam beside them, Apex's on the path a GPU host takes).

A source run takes ``STEPS`` steps, saves ``fully_sharded_model_space`` (0.14's default) with ``dist_checkpointing`` (the
save aligns the chained steps) and takes two more (the reference). A target run (other initial
values) loads the checkpoint as Megatron does and takes the same two steps: the model, main shards,
Adam moments and the CPU optimizers' copies after each are compared with the reference's
(``next1/``, ``next2/``). Without the fix: with fraction 1.0 the load stops (phase ``load``); with
0.5 the source run's first step after its save stops (phase ``save``).

What is not real on a CPU host: the GPU (:mod:`mcore_ckpt_fixes.testing.offload`), Apex's FusedAdam
(a stand-in with its interface) and the gradients.
"""

from __future__ import annotations

import os

from ....testing.dist_optimizer import SOURCE_SEED, Shape, one_case, request, run_cases, save_request, step
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.offload import build_offload_fraction, deriving, load_offloaded, offload_path, stepped_states
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 3  # the source run's steps before the save
NEXT = (STEPS, STEPS + 1)  # the two steps after it, of the reference and of the resumed run
TARGET_SEED = 98765
FORMAT = "fully_sharded_model_space"  # 0.14's default (fully_reshardable comes in 0.15)
FRACTIONS = {"full_offload": 1.0, "partial_offload": 0.5}  # case -> --optimizer-offload-fraction
CASES = tuple(FRACTIONS)
MLP = "decoder.layers.0.mlp"
SHAPE = Shape(expert_params=tuple(f"{MLP}.linear_fc{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")))


def _build(seed, device, name):
    model, opt = build_offload_fraction(seed, device, FRACTIONS[name], shape=SHAPE)
    chained = getattr(opt, "chained_optimizers", None)
    assert chained is not None and len(chained) == 2, f"expected a dense and an expert optimizer, got {opt!r}"
    return model, opt


def _source(name, ckpt_dir, cache, device):
    if name not in cache:
        model, opt = _build(SOURCE_SEED, device, name)
        with deriving(device):
            for i in range(STEPS):
                step(model, opt, i)
        path = os.path.join(ckpt_dir, f"{name}-{FORMAT}")
        save_request(request(model, opt, FORMAT, False), path)
        cache[name] = (path, stepped_states(model, opt, device, NEXT))
    return cache[name]


def run_case(name, ckpt_dir, patched, cache=None):
    rt = RoundTrip(case=name)
    with rt.running(), offload_path(apex=True) as device:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        path, reference = _source(name, ckpt_dir, {} if cache is None else cache, device)
        model, opt = _build(TARGET_SEED, device, name)
        rt.phase("load")
        load_offloaded(model, opt, path, FORMAT, device)
        rt.phase("steps")
        got = stepped_states(model, opt, device, NEXT)
        rt.phase("compare")
        for i, (want, have) in enumerate(zip(reference, got), start=1):
            rt.compare(want, have, prefix=f"next{i}/")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """The cases in one world: ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched, device)


full_offload = one_case(run_case, "full_offload")
partial_offload = one_case(run_case, "partial_offload")
