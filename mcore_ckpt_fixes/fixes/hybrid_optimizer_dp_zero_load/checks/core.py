"""hybrid-optimizer-dp-zero-load's round trips on 2 gloo ranks (DP=2): Megatron's DDP and distributed
optimizer with ``optimizer_cpu_offload`` and the precision-aware optimizer (as Megatron-LM requires
it), saved and loaded in the legacy ``torch`` format as ``megatron.training`` does it: each rank's
model and optimizer ``state_dict`` in a file of its own, the parameter state gathered to DP rank 0
(``save_parameter_state``, dp_zero); loaded into a fresh run in ``load_checkpoint``'s order: the
model's ``load_state_dict``, the optimizer's, then ``load_parameter_state``.

A source run takes ``STEPS`` steps on deterministic gradients, saves, and takes two more (the
reference). A target run (other initial values) loads and takes the same two. Checked on every rank:
right after the load, the model, main shards, Adam moments, master parameters and the copies the
sub-optimizers step against the source's at the save (``loaded/``), then after each step against
the reference (``next1/``, ``next2/``). Any difference ends the case in phase ``judge`` with
:data:`scenarios.STALE`; ``loaded_differs`` names the kinds that differed right after the load.
Cases: ``full_offload`` (fraction 1.0, the default: CPU AdamW steps every parameter's fp32 copy)
and ``partial_offload`` (0.5: half on a GPU FusedAdam, whose fp32 copies are written back by
another hook; its second step needs hybrid-optimizer-gpu-step).

What is not real on a CPU host: the GPU (:mod:`mcore_ckpt_fixes.testing.offload`: the parameters and
the fp32 copies made of them report ``is_cuda``), Apex's FusedAdam (a stand-in with its interface)
and the gradients.
"""

from __future__ import annotations

import os

from ....testing.dist_optimizer import SOURCE_SEED, distributed, one_case, run_cases, step
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.offload import build_offload_fraction, deriving, offload_path, offloaded_state, stepped_states
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import DIST_MODULE, ID, MODULE

STEPS = 3  # the source run's steps before the save
NEXT = (STEPS, STEPS + 1)  # the two steps after it, of the reference and of the resumed run
TARGET_SEED = 98765
FRACTIONS = {"full_offload": 1.0, "partial_offload": 0.5}  # case -> --optimizer-offload-fraction
CASES = tuple(FRACTIONS)


def _files(ckpt_dir, name):
    import torch.distributed as dist

    folder = os.path.join(ckpt_dir, name)
    return os.path.join(folder, f"model_optim_rng_{dist.get_rank()}.pt"), os.path.join(folder, "distrib_optim.pt")


def save_legacy(model, opt, ckpt_dir, name):
    """``megatron.training``'s torch format: this rank's model and optimizer state dicts, and the
    parameter state gathered to DP rank 0."""
    import torch
    import torch.distributed as dist

    own, shared = _files(ckpt_dir, name)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(own), exist_ok=True)
    dist.barrier()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, own)
    opt.save_parameter_state(shared)
    dist.barrier()


def load_legacy(model, opt, ckpt_dir, name):
    """``load_checkpoint``'s order: the model, the optimizer's state dict, the parameter state."""
    import torch

    own, shared = _files(ckpt_dir, name)
    saved = torch.load(own, weights_only=False)  # this round trip's own file
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    opt.load_parameter_state(shared)


def _source(name, ckpt_dir, cache, device):
    if name not in cache:
        model, opt = build_offload_fraction(SOURCE_SEED, device, FRACTIONS[name])
        with deriving(device):
            for i in range(STEPS):
                step(model, opt, i)
        at_save = offloaded_state(model, opt)
        save_legacy(model, opt, ckpt_dir, name)
        cache[name] = (at_save, stepped_states(model, opt, device, NEXT))
    return cache[name]


def judge(rt) -> None:
    """End the case with :data:`scenarios.STALE` where anything differs."""
    rt.phase("judge")
    rt["loaded_differs"] = sorted({k.split("/")[1] for k, d in rt.differing().items() if k.startswith("loaded/")})
    if rt.differing():
        raise AssertionError("the resumed run is not the saved run")


def run_case(name, ckpt_dir, patched, cache=None):
    rt = RoundTrip(case=name, loaded_differs=None)
    with rt.running(), offload_path(apex=True) as device:
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE, DIST_MODULE), patched)
        rt.phase("save")
        at_save, reference = _source(name, ckpt_dir, {} if cache is None else cache, device)
        model, opt = build_offload_fraction(TARGET_SEED, device, FRACTIONS[name])
        rt.phase("load")
        with deriving(device):  # the load rebuilds the sub-optimizers and their copies
            load_legacy(model, opt, ckpt_dir, name)
        rt["hybrid"] = [type(d.optimizer).__name__ for d in distributed(opt)]
        rt.compare(at_save, offloaded_state(model, opt), prefix="loaded/")
        for i, (want, have) in enumerate(zip(reference, stepped_states(model, opt, device, NEXT)), start=1):
            rt.compare(want, have, prefix=f"next{i}/")
        judge(rt)
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """The cases in one world (one source save each): ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched, device)


full_offload = one_case(run_case, "full_offload")
partial_offload = one_case(run_case, "partial_offload")
