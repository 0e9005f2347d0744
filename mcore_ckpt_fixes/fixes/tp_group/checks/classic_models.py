"""tp-group must change nothing for a model built the classic way (``parallel_state`` initialised).

On a gloo world of 2 (TP=2) with ``parallel_state.initialize_model_parallel``, each model of the
tp-group scenarios is built once with the fix reverted and once with it applied, from the same
seed. The full sharded-state-dict description (every ShardedTensor's key, global shape, global
offset, fragmentation and replica id, after the factories are built) and every tensor value must be
identical, and the patched model must round-trip through ``dist_checkpointing`` exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....testing.compare import max_abs_delta, worst
from . import core as explicit


def _describe(sd):
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    apply_factories(sd)
    out = []
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            out.append(
                (
                    "T",
                    v.key,
                    tuple(v.global_shape),
                    tuple(v.global_offset),
                    tuple(v.axis_fragmentations),
                    repr(v.replica_id),
                    tuple(v.local_shape),
                )
            )
        elif isinstance(v, ShardedObject):
            out.append(("O", v.key, tuple(v.global_shape), tuple(v.global_offset), repr(v.replica_id)))
    return sorted(out)


def _builders(pgs):
    """The mixer and RADIO models of the explicit-group scenarios, built from parallel_state's groups."""
    return {
        "mamba_mixer": explicit.mixer_factory(pgs),  # MambaMixer requires a pg_collection
        "radio_vit": explicit.radio_factory(None),  # the classic call: groups from parallel_state
    }


def classic_models_identical(rank: int, world_size: int, ckpt_dir: str) -> dict:
    import mcore_ckpt_fixes
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        results = {}
        for name, build in _builders(pgs).items():
            built = {}
            for patched in (False, True):
                mcore_ckpt_fixes.revert()
                if patched:
                    mcore_ckpt_fixes.apply({})  # defaults: auto
                explicit.seed_rng(7, parallel_state.get_tensor_model_parallel_rank())
                model = build()
                explicit.fill_deterministic(model, 7, parallel_state.get_tensor_model_parallel_rank())
                built[patched] = (model, _describe(model.sharded_state_dict(prefix="")))
            (m_off, d_off), (m_on, d_on) = built[False], built[True]
            sd_off, sd_on = m_off.state_dict(), m_on.state_dict()
            same_values = sd_off.keys() == sd_on.keys() and all(
                torch.equal(sd_off[k], sd_on[k]) for k in sd_off if isinstance(sd_off[k], torch.Tensor)
            )
            # Round trip with the fix on.
            path = f"{ckpt_dir}/{name}"
            if rank == 0:
                import os

                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(m_on.sharded_state_dict(prefix=""), path)
            dist.barrier()
            explicit.seed_rng(8, parallel_state.get_tensor_model_parallel_rank())
            fresh = build()
            explicit.fill_deterministic(fresh, 8, parallel_state.get_tensor_model_parallel_rank())
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(prefix=""), path))
            after = fresh.state_dict()
            delta = worst(max_abs_delta(sd_on[k], after[k]) for k in sd_on if isinstance(sd_on[k], torch.Tensor))
            results[name] = {
                "descriptions_equal": d_off == d_on,
                "n_sharded": len(d_on),
                "values_equal": same_values,
                "round_trip_max_delta": delta,
            }
        return results
    finally:
        parallel_state.destroy_model_parallel()


def save_load_timing(rank: int, world_size: int, ckpt_dir: str, repeats: int = 5) -> dict:
    """Median sharded_state_dict + save + load time with the fix reverted and applied, interleaved.

    Measured on the classic path because that is the only one where the unpatched release can
    save at all; the explicit-group path runs the same wrappers.
    """
    import os
    import statistics
    import time

    import mcore_ckpt_fixes
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        builders = _builders(pgs)
        times = {False: [], True: []}
        for i in range(repeats):
            for patched in (False, True) if i % 2 == 0 else (True, False):
                mcore_ckpt_fixes.revert()
                if patched:
                    mcore_ckpt_fixes.apply({})
                explicit.seed_rng(7, parallel_state.get_tensor_model_parallel_rank())  # RNG tracker
                models = {name: build() for name, build in builders.items()}
                path = f"{ckpt_dir}/{i}-{int(patched)}"
                if rank == 0:
                    os.makedirs(path, exist_ok=True)
                dist.barrier()
                start = time.perf_counter()
                sd = {}
                for name, model in models.items():
                    sd.update(model.sharded_state_dict(prefix=f"{name}."))
                dist_checkpointing.save(sd, path)
                dist.barrier()
                sd = {}
                for name, model in models.items():
                    sd.update(model.sharded_state_dict(prefix=f"{name}."))
                dist_checkpointing.load(sd, path)
                dist.barrier()
                times[patched].append(time.perf_counter() - start)
        return {"unpatched_s": statistics.median(times[False]), "patched_s": statistics.median(times[True])}
    finally:
        parallel_state.destroy_model_parallel()
