"""fully-reshardable-buckets' round trips: Megatron's DDP and distributed optimizer
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`) with a gradient buffer of several buckets
(``overlap_grad_reduce`` and a small ``bucket_size``, as Megatron-LM's ``--overlap-grad-reduce
--ddp-bucket-size``), saved in ``fully_reshardable`` format with ``dist_checkpointing`` on 2 gloo
ranks (DP=2), on the optimizer path users train on (Apex FusedAdam's interface, the CPU stand-in of
:mod:`mcore_ckpt_fixes.testing._fused_adam`).

A source run takes ``STEPS`` optimizer steps and saves; one more step is the reference. A target run
(other initial values) builds Megatron's own load request (``is_loading=True``), loads and takes the
same next step:

* ``buckets``: the target has the source's buckets;
* ``reshard``: the target's buffer is one bucket (what the format is for: another layout reads it);
* ``mem_efficient``: as ``buckets``, gathered with ``distrib_optim_fully_reshardable_mem_efficient``
  (over gloo, onto data-parallel rank 0 only).

Compared per parameter, whole (each rank's shard put in place and summed over the ranks, so that
different layouts compare): the fp32 main value and both Adam moments after the load equal the
source's at the save (``max_delta``), and after one more step the uninterrupted run's (``next/``),
where the target has the source's layout: the step's last bits depend on how the buffer is cut
(uninterrupted runs with one bucket and with six differ in the last bit of some values), so
``reshard`` compares what was loaded only.
Without the fix the load completes and the values differ (parameters after the first bucket): the
check stops in phase ``restored`` with one ``AssertionError`` line, the differences recorded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ....testing._fused_adam import optimizer_path
from ....testing.dist_optimizer import build, full_state, one_case, run_cases, save_request, step
from ....testing.dist_optimizer import prepare  # noqa: F401  (the scenarios' prepare)
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

STEPS = 3
SOURCE_SEED, TARGET_SEED = 1234, 98765
BUCKET_SIZE = 4000  # elements: the one-layer GPT's buffer in several buckets
RESTORED_OTHER_VALUES = "the load restored other values than the source saved"


@dataclass(frozen=True)
class Case:
    target_bucket_size: object = BUCKET_SIZE  # None: one bucket
    mem_efficient: bool = False


CASES = {
    "buckets": Case(),
    "reshard": Case(target_bucket_size=None),
    "mem_efficient": Case(mem_efficient=True),
}


def _request(model, opt, is_loading, mem_efficient):
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    if mem_efficient:
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def _source(case: Case, ckpt_dir, cache):
    """Save the source run (once per gathering mode in a world): (path, saved state, reference)."""
    if case.mem_efficient not in cache:
        model, opt = build(SOURCE_SEED, bucket_size=BUCKET_SIZE)
        buckets = [len(b.buckets) for b in model.buffers]
        assert buckets[0] > 1, f"the source's gradient buffer has {buckets} bucket(s): nothing to check"
        for i in range(STEPS):
            step(model, opt, i)
        path = os.path.join(ckpt_dir, f"mem_efficient{case.mem_efficient}")
        save_request(_request(model, opt, False, case.mem_efficient), path)
        saved = full_state(model, opt)
        step(model, opt, STEPS)
        cache[case.mem_efficient] = (path, saved, full_state(model, opt))
    return cache[case.mem_efficient]


def run_case(name, ckpt_dir, patched, cache=None):
    """One case (``CASES``) in a world whose parallel state is initialised: its RoundTrip result."""
    from megatron.core import dist_checkpointing

    case = CASES[name]
    rt = RoundTrip(case=name, sharding_type="fully_reshardable", steps=None)
    with rt.running(), optimizer_path(apex=True):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        path, saved, reference = _source(case, ckpt_dir, {} if cache is None else cache)
        model, opt = build(TARGET_SEED, bucket_size=case.target_bucket_size)
        rt["buckets"] = [len(b.buckets) for b in model.buffers]
        rt.phase("load")
        loaded = dist_checkpointing.load(_request(model, opt, True, case.mem_efficient), path)
        model.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        if rt.compare(saved, full_state(model, opt)):
            rt.phase("restored")  # the release says nothing: the check does
            raise AssertionError(RESTORED_OTHER_VALUES)
        if case.target_bucket_size == BUCKET_SIZE:
            step(model, opt, STEPS)
            rt.compare(reference, full_state(model, opt), prefix="next/")
    return rt.result


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Several cases in one world (one source save per gathering mode): ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched, device)


buckets = one_case(run_case, "buckets")
reshard = one_case(run_case, "reshard")
