"""rng-under-ep round trips through Megatron-Bridge's own ``save_checkpoint`` / ``load_checkpoint``.

World 2 with EP=2 (TP=PP=1, so DP=2 and the two EP ranks are the two data-parallel ranks), a small
real Megatron-Core ``GPTModel`` with two local (non-TE) experts, one per EP rank, and a real Bridge
``ConfigContainer`` / ``GlobalState`` (Bridge's own config classes, defaults everywhere except the
checkpoint paths, the format and "no optimizer"). Bridge's ``save_checkpoint`` builds the state
dict with its own ``get_rng_state`` and writes it; its ``load_checkpoint`` asks for the RNG entry
with ``get_rng_state`` again, loads it and restores every generator: the whole path a Bridge
training run takes, on both of its formats:

* ``fsdp_dtensor`` (the bug): Bridge keys the plain RNG entry ``{"(pp, tp)": [state]}``; DCP keeps
  one copy of each leaf, written by different data-parallel ranks, so both EP ranks restore a mix.
* ``torch_dist``: Bridge 0.6.2 already shards the RNG ``ShardedObject`` by (pp, tp, dp_cp) when
  EP > 1 (``replica_id=0``): every rank restores its own state, with or without the fix.

The model is not wrapped in Megatron-FSDP (its CUDA buffers cannot be built on a CPU host; the
RNG entry does not depend on the wrapper): Bridge's ``fsdp_dtensor`` branches run on the plain
model's state dict, as Megatron-LM's do in :mod:`.core`.

Seeding as a Bridge run does it: Bridge's ``_set_random_seed`` (Python, NumPy, torch from
``seed + 100 * pp_rank``); it seeds Megatron's RNG tracker (``model_parallel_cuda_manual_seed`` with
the tp/ep/etp ranks of the process groups, the expert stream per EP rank) only when it sees a GPU, so
on a CPU host this module makes the same call itself. Then every rank draws a rank-dependent number
of values from every generator and tracker stream, so every component differs between the ranks.

Stand-ins (test and selftest workers only): :class:`.core.CudaRngStandIn` (one CPU generator
plays the CUDA default generator) and, for ``import megatron.bridge``, the Transformer Engine
stand-in of :func:`mcore_ckpt_fixes.testing._standins.install_transformer_engine_stand_in_for_bridge`
(visible to ``megatron.bridge.peft.lora_layers``' import only).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from ....testing.bridge_config import cpu_gpt_provider, round_trip_config
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID as FIX_ID
from .core import CudaRngStandIn, compare_exact, consume_streams, model_tensors, scramble_parameters, snapshot
from ....testing.quiet import quiet

MODULE = "megatron.bridge.training.checkpointing"
EP = 2
SEED, FRESH_SEED = 1234, 4321


def prepare() -> None:
    """Run in the parent before any world starts: import what the ranks use, once."""
    from ....testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    import megatron.bridge.training.checkpointing  # noqa: F401
    import megatron.bridge.training.config  # noqa: F401
    import megatron.bridge.training.initialize  # noqa: F401
    import megatron.bridge.training.state  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401


def _config(ckpt_dir, ckpt_format):
    """Bridge's own ConfigContainer, its defaults but for what a checkpoint round trip needs: a
    one-layer MoE GPT, one expert per EP rank, its RNG state saved and loaded."""
    model = cpu_gpt_provider(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=32,
        num_moe_experts=EP,
        expert_model_parallel_size=EP,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
    )
    return round_trip_config(model, ckpt_dir, ckpt_format, rng=True)


def _setup(ckpt_dir, ckpt_format):
    """Bridge's config and state, parallel state, a model."""
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    cfg = _config(ckpt_dir, ckpt_format)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=EP
    )
    assert mpu.get_expert_model_parallel_world_size() == EP and mpu.get_data_parallel_world_size() == EP
    destroy_num_microbatches_calculator()
    # load_checkpoint updates the microbatch calculator from the consumed samples it restores.
    init_num_microbatches_calculator(dist.get_rank(), None, 2, 1, EP)
    state = GlobalState()
    state.cfg = cfg
    # Replicated (non-expert) weights equal on every rank, as after a real init.
    torch.manual_seed(SEED)
    model = GPTModel(
        cfg.model,
        get_gpt_layer_local_spec(num_experts=EP, moe_grouped_gemm=False),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
    )
    return state, model


def seed_as_bridge(seed, data_parallel_random_init=False):
    """Bridge's seeding (``_set_random_seed``: Python, NumPy, torch); on a CPU host also Megatron's
    RNG tracker, which Bridge seeds only when it sees a GPU, with the same call it would make."""
    from megatron.bridge.training.initialize import _set_random_seed
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank

    pgs = ProcessGroupCollection.use_mpu_process_groups()
    _set_random_seed(seed, data_parallel_random_init, pg_collection=pgs)
    if not torch.cuda.device_count():
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed + 100 * get_pg_rank(pgs.pp),
            tp_rank=get_pg_rank(pgs.tp),
            ep_rank=get_pg_rank(pgs.ep),
            etp_rank=get_pg_rank(pgs.expt_tp),
        )


def _seed_and_consume(state, stand_in, seed):
    """Bridge's seeding, then rank-dependent draws from every generator and tracker stream."""
    seed_as_bridge(seed, state.cfg.rng.data_parallel_random_init)
    consume_streams(stand_in, seed)


def _layout(state):
    """What Bridge's get_rng_state (with or without the fix) describes for this rank."""
    from megatron.bridge.training import checkpointing
    from megatron.core.process_groups_config import ProcessGroupCollection

    obj = checkpointing.get_rng_state(
        state.cfg.rng.data_parallel_random_init,
        state.cfg.checkpoint.ckpt_format,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    if isinstance(obj, dict):  # fsdp_dtensor: a plain dict, keyed by its layout
        return sorted(obj)
    return list(obj.global_shape), list(obj.global_offset), obj.replica_id


def _round_trip():
    rt = RoundTrip(device="cpu", saved=None, loaded=None, warnings=[], layout=None)
    rt.phase("setup")
    return rt


def _save(state, model, stand_in, rt, patched):
    from megatron.bridge.training.checkpointing import save_checkpoint

    _seed_and_consume(state, stand_in, SEED)
    rt.phase("precondition")
    rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
    rt["layout"] = _layout(state)
    rt.phase("save")
    saved = snapshot()
    state.train_state.step = 1
    with quiet():
        save_checkpoint(state, [model], None, None, 0)
    dist.barrier()
    return saved


def _load(state, model, stand_in, rt):
    from megatron.bridge.training.checkpointing import load_checkpoint

    rt.phase("perturb")
    _seed_and_consume(state, stand_in, FRESH_SEED)  # other states than the saved ones, on every rank
    before = snapshot()
    rt.phase("load")
    with warnings.catch_warnings(record=True) as caught, quiet():
        warnings.simplefilter("always")
        load_checkpoint(state, [model], None, None)
    # This fix's MegatronPatchWarning, or the plain warning of the source patch.
    rt["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught if "RNG state" in str(w.message)]
    assert state.train_state.step == 1, f"load_checkpoint restored step {state.train_state.step}, expected 1"
    return before, snapshot()


def _teardown():
    from megatron.core import parallel_state as mpu

    with contextlib.suppress(Exception):
        mpu.destroy_model_parallel()


# -- scenarios --------------------------------------------------------------------------------------


def ep2_round_trip(rank, world_size, ckpt_dir, patched, ckpt_format="fsdp_dtensor"):
    """save_checkpoint, new RNG states everywhere, load_checkpoint: every rank's RNG states (and its
    model, experts included) must be what it saved. ``max_delta``: per RNG component."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, rt.running():
        state, model = _setup(ckpt_dir, ckpt_format)
        saved = _save(state, model, stand_in, rt, patched)
        saved_model = model_tensors(model)
        scramble_parameters(model)
        _, loaded = _load(state, model, stand_in, rt)
        compare_exact(rt, saved, loaded, saved_model, model_tensors(model))
    _teardown()
    return rt.result


def save_only(rank, world_size, ckpt_dir, patched, ckpt_format="fsdp_dtensor"):
    """The save half alone (``saved``: this rank's RNG states as they went into the checkpoint)."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, rt.running():
        state, model = _setup(ckpt_dir, ckpt_format)
        rt["saved"] = _save(state, model, stand_in, rt, patched)
        rt["n_tensors"] = len(rt["saved"])
    _teardown()
    return rt.result


def load_only(rank, world_size, ckpt_dir, patched, ckpt_format="fsdp_dtensor", strict=False):
    """The load half alone, in a fresh world (``before``: the states just before loading,
    ``loaded``: just after; ``warnings``: the warnings about the RNG state the load raised).
    ``strict``: Bridge's ``strict_fsdp_dtensor_load`` (DCP refuses keys the checkpoint lacks)."""
    assert world_size == EP, f"rng-under-ep scenarios need world size {EP}, got {world_size}"
    rt = _round_trip()
    with CudaRngStandIn() as stand_in, rt.running():
        state, model = _setup(ckpt_dir, ckpt_format)
        state.cfg.checkpoint.strict_fsdp_dtensor_load = strict
        rt.phase("precondition")
        rt["fix_state"] = fix_states(FIX_ID, (MODULE,), patched)
        rt["before"], rt["loaded"] = _load(state, model, stand_in, rt)
        rt["n_tensors"] = len(rt["loaded"])
    _teardown()
    return rt.result
