"""numpy2-product's round trip: what Megatron-LM's ``save_checkpoint``/``load_checkpoint`` do with
``torch_dist`` and their defaults, on 2 gloo ranks (DP=2).

A one-layer GPT (local spec), Megatron's DDP and distributed optimizer (``get_megatron_optimizer``;
torch's Adam on a CPU host), ``STEPS`` optimizer steps on deterministic gradients
(:mod:`mcore_ckpt_fixes.testing.dist_optimizer`), saved through ``FullyParallelSaveStrategyWrapper``
(``--ckpt-fully-parallel-save``, Megatron-LM's default: the exchange sizes every shard) and loaded
through ``FullyParallelLoadStrategyWrapper`` into a model built from other values that has taken one
step (torch Adam keeps no state before one). Two cases (``CASES``): the model alone (the selftest
scenario), and the model with the optimizer in the release's default format
(``fully_sharded_model_space`` before 0.16: flattened shards, whose coverage the save checks).
Checked on every rank: the model parameters (and main-parameter shards and Adam moments) equal what
was saved, and with the optimizer, after one more step, the uninterrupted run's (``next/...``).

What is not real: the gradients and the CUDA tensors, as that module says.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from ....testing import dist_optimizer
from ....testing.dist_optimizer import SOURCE_SEED, build, local_state, one_case, run_cases, step
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULES

STEPS = 2
TARGET_SEED = 4321
# The modules this round trip reaches (mapping's np.product is the zarr backend's only).
USED = MODULES[:2]
# case -> whether the optimizer is saved too
CASES = {
    # Only the model: every rank sizes its shards for the fully parallel exchange (np.product).
    "model": False,
    # With the optimizer's flattened shards, whose coverage rank 0 checks first (np.product), while
    # the other ranks wait for it in a collective.
    "optimizer": True,
}


def prepare() -> None:
    """The scenario's warm imports (parent, before any world forks), the fully parallel strategies
    with them: they import exchange_utils, whose fix state the round trip asserts."""
    dist_optimizer.prepare()
    import megatron.core.dist_checkpointing.strategies.fully_parallel  # noqa: F401


def _request(model, opt, is_loading, with_optimizer):
    model_sd = model.module.sharded_state_dict()
    if not with_optimizer:
        return {"model": model_sd}
    # No format named: the release's default, as megatron.training asks without --ckpt-fully-reshardable.
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=is_loading)}


def _strategies(path):
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    group = mpu.get_data_parallel_group(with_context_parallel=True)
    save = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group)
    return save, lambda: FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path), group)


def run_case(name, ckpt_dir, patched, cache=None):
    """One case (``CASES``) in a world whose parallel state is initialised: its RoundTrip result."""
    from megatron.core import dist_checkpointing

    with_optimizer = CASES[name]
    rt = RoundTrip(case=name, sharding_type="release default" if with_optimizer else None, steps=STEPS)
    with rt.running():
        rt.phase("precondition")
        import megatron.core.dist_checkpointing.strategies.fully_parallel  # noqa: F401  (selftest: no prepare)

        rt["fix_state"] = fix_states(ID, USED, patched)
        model, opt = build(SOURCE_SEED)
        for i in range(STEPS):
            step(model, opt, i)
        path = os.path.join(ckpt_dir, name)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        save_strategy, load_strategy = _strategies(path)
        rt.phase("save")
        dist_checkpointing.save(_request(model, opt, False, with_optimizer), path, save_strategy)
        saved = _state(model, opt, with_optimizer)
        step(model, opt, STEPS)
        reference = _state(model, opt, with_optimizer)
        model, opt = build(TARGET_SEED)
        step(model, opt, 100)
        rt.phase("load")
        loaded = dist_checkpointing.load(_request(model, opt, True, with_optimizer), path, load_strategy())
        model.module.load_state_dict(loaded["model"])
        if with_optimizer:
            opt.load_state_dict(loaded["optimizer"])
        got = _state(model, opt, with_optimizer)
        rt.compare(saved, got)
        if with_optimizer:
            step(model, opt, STEPS)
            rt.compare(reference, local_state(model, opt), prefix="next/")
    return rt.result


def _state(model, opt, with_optimizer):
    state = local_state(model, opt)
    return state if with_optimizer else {k: v for k, v in state.items() if k.startswith("model/")}


def cases(rank, world_size, ckpt_dir, patched, device="cpu", names=None):
    """Both cases in one world: ``{case: result}``."""
    return run_cases(run_case, names or CASES, ckpt_dir, patched)


model = one_case(run_case, "model")
