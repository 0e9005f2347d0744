"""factory-merges-non-strict's round trip on 2 gloo ranks (TP=2): a one-layer SwiGLU GPT (local spec,
bf16 values, ``linear_fc1`` a ShardedTensorFactory per rank) saved with ``dist_checkpointing``,
then loaded into the same model with a multi-token-prediction layer added (``mtp_num_layers=1``:
its SwiGLU ``linear_fc1`` is in no checkpoint), as a run that adds MTP to a trained model does.

Phase ``load``: one load per strictness of :data:`WAYS`, each outcome recorded (``"ok"`` or the
error line) with the keys it returned; where it loads, every tensor of the saved model compared with
what was saved, and the MTP layer's keys listed (``absent``: not in what was loaded, as the
checkpoint has none). A tolerant strictness stopped in ``apply_factory_merges`` ends the phase with
:data:`scenarios.STOPPED` (the first such error kept as ``first_error``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE
from .scenarios import STOPPED

# The default (which refuses keys the checkpoint lacks before reading), and the three that go on.
WAYS = ("assume_ok_unexpected", "log_all", "ignore_all", "return_all")
MERGE_ERROR = "ValueError: Different dict keys encountered in `apply_factory_merges`"


def prepare() -> None:
    import megatron.core.dist_checkpointing  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401


def build(mtp: bool, seed: int):
    """The GPT (TP=2 over the world), with an MTP layer where ``mtp``; parameters drawn from ``seed``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=2,
        gated_linear_unit=True,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        mtp_num_layers=1 if mtp else None,
    )
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    return GPTModel(config, spec, vocab_size=32, max_sequence_length=8, mtp_block_spec=mtp_spec)


def saved_tensors(model) -> dict:
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and "_extra_state" not in k
    }


def load_each_way(rt, ckpt_dir, saved):
    from megatron.core import dist_checkpointing

    for strict in WAYS:
        target = build(mtp=True, seed=98765)
        try:
            loaded = dist_checkpointing.load(target.sharded_state_dict(), ckpt_dir, strict=strict)
        except (Exception, CheckpointException) as exc:  # torch's is a BaseException
            rt["outcomes"][strict] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        state = loaded[0] if isinstance(loaded, tuple) else loaded
        rt["outcomes"][strict] = "ok"
        rt["absent"][strict] = sorted(k for k in target.state_dict() if k not in state and k.startswith("mtp."))
        got = {k: v for k, v in state.items() if k in saved and isinstance(v, torch.Tensor)}
        rt.compare({k: saved[k] for k in got}, got, prefix=f"{strict}/")
        rt.phase("load")


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu

    rt = RoundTrip(outcomes={}, absent={})
    save_dir = os.path.join(ckpt_dir, "gpt")
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        mpu.initialize_model_parallel(tensor_model_parallel_size=2)
        try:
            rt.phase("save")
            source = build(mtp=False, seed=1234)
            if rank == 0:
                os.makedirs(save_dir, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(source.sharded_state_dict(), save_dir)
            rt.phase("load")
            load_each_way(rt, save_dir, saved_tensors(source))
        finally:
            mpu.destroy_model_parallel()
        if any(outcome.startswith(MERGE_ERROR) for outcome in rt["outcomes"].values()):
            raise AssertionError(STOPPED.partition(": ")[2])
    return rt.result
