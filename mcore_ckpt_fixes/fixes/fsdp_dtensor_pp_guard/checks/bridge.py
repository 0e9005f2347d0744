"""fsdp-dtensor-pp-guard's round trip through Megatron-Bridge's own ``save_checkpoint`` and
``load_checkpoint`` in the ``fsdp_dtensor`` format, on 2 gloo ranks: a 2-layer GPT (Bridge's own
``GPTModelProvider``, real Megatron-Core ``GPTModel`` per stage) saved with PP=1 (DP=2), loaded with
PP=2 (stage 1 holds global layer 1 as its ``decoder.layers.0``), then with PP=1 again. Bridge's own
``ConfigContainer`` / ``GlobalState`` (defaults but for the checkpoint paths, the format, "no
optimizer, no RNG": the layer weights are what the guard is about); the run's
``cfg.model.pipeline_model_parallel_size`` is the layout it is started with, as in a Bridge run.

What is real: Bridge's ``save_checkpoint`` (its fsdp_dtensor branch: ``generate_state_dict`` from the
model's ``state_dict_for_save_checkpoint``, ``preprocess_fsdp_dtensor_state_dict``,
``save_fsdp_dtensor_checkpoint``, DCP, ``run_config.yaml``) and ``load_checkpoint``
(``_load_checkpoint_from_path``'s fsdp_dtensor branch, which reads ``run_config.yaml`` and compares
(TP, PP) only to skip the RNG state, ``load_fsdp_dtensor_checkpoint``, DCP's non-strict load, Bridge's
``_load_model_state_dict``).

Stand-in: Megatron-FSDP. Its wrapper builds its buffers on the current CUDA device
(``megatron_fsdp.py``: ``MegatronFSDP.__init__`` refuses any other device, and makes
``torch.cuda.Stream``\\ s), so it cannot run on a CPU host: the model is the plain ``GPTModel``
(Bridge's ``unwrap_model`` passes it through) and Bridge's fsdp_dtensor branches run on its state
dict, as rng-under-ep's Bridge round trips do. The keys are the same stage-local module names either
way (Megatron-FSDP's state dict is its module's, with DTensor values); ``run_config.yaml``, which the
guard reads, does not depend on the wrapper. The Transformer Engine stand-in of
:func:`mcore_ckpt_fixes.testing._standins.install_transformer_engine_stand_in_for_bridge` lets
Bridge import (nothing of it runs).

Phases: ``save``; ``load`` (PP=2; with the guard the refusal, one ``ValueError`` line, is recorded as
``refusal`` and the scenario goes on); ``layers`` (without the guard: stage 1's first layer compared
with the checkpoint's layers, one ``AssertionError`` line on every rank when it holds layer 0);
``same layout`` (PP=1 again: every layer weight equals what was saved, ``max_delta``). The same in
``torch_dist`` is the control: Bridge's sharded state dict names layers by their global number, so
the PP=2 load is right and the guard leaves it alone.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ....testing.bridge_config import cpu_gpt_provider, round_trip_config
from ....testing.quiet import quiet
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID

MODULE = "megatron.bridge.training.checkpointing"
SEED = 1234
LAYER = "decoder.layers.0.self_attention.linear_proj.weight"


def prepare() -> None:
    """Run in the parent before any world starts: import what the ranks use, once."""
    from ....testing._standins import install_transformer_engine_stand_in_for_bridge

    install_transformer_engine_stand_in_for_bridge()
    import megatron.bridge.training.checkpointing  # noqa: F401
    import megatron.bridge.training.config  # noqa: F401
    import megatron.bridge.training.state  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401


def _config(ckpt_dir, pp, ckpt_format):
    """Bridge's own ConfigContainer, its defaults but for what this round trip needs: a two-layer
    GPT over ``pp`` pipeline stages, no RNG state."""
    model = cpu_gpt_provider(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        vocab_size=32,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
    )
    return round_trip_config(model, ckpt_dir, ckpt_format, rng=False)


def start(ckpt_dir, pp, ckpt_format="fsdp_dtensor"):
    """Bridge's config and state for a run with PP=``pp`` on this world, its parallel state and
    this stage's model (weights from one seed: equal on every data-parallel rank)."""
    from megatron.bridge.training.state import GlobalState
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    with contextlib.suppress(Exception):
        mpu.destroy_model_parallel()
    cfg = _config(ckpt_dir, pp, ckpt_format)
    mpu.initialize_model_parallel(pipeline_model_parallel_size=pp)
    destroy_num_microbatches_calculator()
    # load_checkpoint updates the microbatch calculator from the consumed samples it restores.
    dp = dist.get_world_size() // pp
    init_num_microbatches_calculator(dist.get_rank(), None, 2, 1, dp)
    state = GlobalState()
    state.cfg = cfg
    torch.manual_seed(SEED + 17 * mpu.get_pipeline_model_parallel_rank())
    model = GPTModel(
        cfg.model,
        get_gpt_layer_local_spec(),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
    )
    return state, model


def layers(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".layers." in n}


def overwritten(model):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    return model


def _first_layer_holds(model, saved, stage):
    """Which saved layer this stage's ``decoder.layers.0`` output projection equals (its own global
    layer ``stage``, or layer 0), as the world sees it."""
    got = dict(model.named_parameters())[LAYER]
    own = torch.equal(got, saved[LAYER.replace(".layers.0.", f".layers.{stage}.")])
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (stage, own, torch.equal(got, saved[LAYER])))
    return seen


def save(ckpt_dir, ckpt_format="fsdp_dtensor"):
    """Bridge's save_checkpoint of a PP=1 run at step 1; returns its layer weights."""
    from megatron.bridge.training.checkpointing import save_checkpoint

    state, model = start(ckpt_dir, 1, ckpt_format)
    saved = layers(model)
    assert not torch.equal(saved[LAYER], saved[LAYER.replace(".layers.0.", ".layers.1.")])
    state.train_state.step = 1
    with quiet():
        save_checkpoint(state, [model], None, None, 0)
    dist.barrier()
    return saved


def load(ckpt_dir, pp, ckpt_format="fsdp_dtensor"):
    """Bridge's load_checkpoint into a fresh run with PP=``pp`` (its weights overwritten first).
    Returns the model, and the refusal (one ``ValueError`` line) if the load raised one."""
    from megatron.bridge.training.checkpointing import load_checkpoint

    state, model = start(ckpt_dir, pp, ckpt_format)
    overwritten(model)
    try:
        with quiet():
            load_checkpoint(state, [model], None, None)
    except ValueError as exc:
        return model, str(exc).replace(ckpt_dir, "CKPT")
    assert state.train_state.step == 1, f"load_checkpoint restored step {state.train_state.step}, expected 1"
    return model, None


def pp1_to_pp2(rank, world_size, ckpt_dir, patched, device="cpu", ckpt_format="fsdp_dtensor"):
    """Save with PP=1, load with PP=2, load with PP=1. ``refusal``: the PP=2 load's ``ValueError``
    line; ``untouched``: after a refusal, whether this stage's weights are still the ones the load
    found (nothing was loaded); ``seen``: without a refusal, per rank ``(stage, holds its own global
    layer, holds layer 0)``. ``ckpt_format="torch_dist"``: the control, global layer numbers."""
    from megatron.core import parallel_state as mpu

    assert world_size == 2, f"needs world size 2, got {world_size}"
    rt = RoundTrip(case="bridge_pp1_to_pp2", sharding_type=ckpt_format, steps=None, refusal=None, untouched=None)
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        saved = save(ckpt_dir, ckpt_format)
        rt.phase("load")
        model, rt["refusal"] = load(ckpt_dir, 2, ckpt_format)
        if rt["refusal"] is not None:
            rt["untouched"] = all(bool((p == 7.0).all()) for p in model.parameters())
        else:
            rt.phase("layers")
            seen = _first_layer_holds(model, saved, mpu.get_pipeline_model_parallel_rank())
            rt["seen"] = seen
            if any(stage > 0 and not own and layer0 for stage, own, layer0 in seen):
                raise AssertionError(
                    "stage 1's decoder.layers.0 (global layer 1) holds the checkpoint's layer 0 after a PP=2 "
                    "load of a PP=1 checkpoint"
                )
        rt.phase("same layout")
        model, refusal = load(ckpt_dir, 1, ckpt_format)
        assert refusal is None, refusal
        rt.compare(saved, layers(model))
    with contextlib.suppress(Exception):
        mpu.destroy_model_parallel()
    return rt.result
