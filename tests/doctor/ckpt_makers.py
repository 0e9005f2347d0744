"""Checkpoints for the doctor's tests, saved by the real code paths of this environment's release.

* torch_dist: ``megatron.core.dist_checkpointing.save`` of a plain sharded state dict on 2 gloo ranks
  (EP=2 as Megatron lays it out: a TP-split weight, a replicated norm, each rank's experts under their
  global index (SequentialMLP's ``local_experts.{g}``), a grouped expert tensor with an expert axis,
  the RNG ShardedObject exactly as ``get_rng_state`` builds it for torch_dist: shape (pp, tp),
  replica id = data-parallel rank). With ``integrity``, saved with ``verify_integrity=True``: the
  release writes its integrity manifest ``integrity.json`` (0.17.1 and later).
* fsdp_dtensor-style DCP: ``torch.distributed.checkpoint.save`` on 2 gloo ranks of a state dict keyed
  the way ``preprocess_fsdp_dtensor_state_dict`` leaves it (``weight{g}`` / ``bias{g}`` expert keys,
  ``rng_state`` keyed ``'(pp, tp)'``, a DTensor sharded over the ranks). With ``local_bias_index``
  the biases keep their local index, as the unfixed expert-keys bug writes them.
* legacy torch: ``torch.save`` of the state dict ``megatron.training``'s ``generate_state_dict``
  builds for ckpt_format 'torch' (args Namespace, checkpoint_version, iteration, model, rng_state),
  into the directories ``get_checkpoint_name`` names (the real function where megatron.training is
  importable; 0.16 wheels do not ship it, and 0.17/0.18 need PyYAML to import it). megatron.training's
  ``save_checkpoint`` itself is not run: it needs a built model, optimizer and CUDA-side state.
"""

from __future__ import annotations

import argparse
import os
import random
import signal

TRACKER = "latest_checkpointed_iteration.txt"


def _write_tracker(root, text):
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(text)


def save_torch_dist(rank, world, root, iteration=10, integrity=False):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    ckdir = os.path.join(root, "iter_{:07d}".format(iteration))
    if rank == 0:
        os.makedirs(ckdir, exist_ok=True)
    dist.barrier()
    torch.manual_seed(rank)
    sd = {
        # TP-split along dim 0 (TP = 2 here: the two ranks are also the two TP ranks of this toy layout).
        "qkv": ShardedTensor.from_rank_offsets(
            "decoder.layers.0.self_attention.linear_qkv.weight", torch.randn(4, 4), (0, rank, world), replica_id=0
        ),
        "norm": ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.ones(4), replica_id=rank),
        # A grouped expert weight: axis 0 is the global expert index, each EP rank owns two experts.
        "grouped": ShardedTensor.from_rank_offsets(
            "decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
            torch.randn(2, 4, 4),
            (0, rank, world),
            replica_id=0,
        ),
        "rng": ShardedObject("rng_state", [{"random_rng_state": random.getstate()}], (1, 1), (0, 0), replica_id=rank),
        "args": argparse.Namespace(tensor_model_parallel_size=1, expert_model_parallel_size=2, num_experts=4),
        "iteration": iteration,
    }
    for local in range(2):
        g = rank * 2 + local
        for param in ("linear_fc1.weight", "linear_fc2.weight"):
            key = f"decoder.layers.0.mlp.experts.local_experts.{g}.{param}"
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.randn(4, 4), replica_id=0)
    # integrity: Megatron's own integrity manifest (integrity.json, verify_integrity=True: 0.17.1+).
    dist_checkpointing.save(sd, ckdir, **({"verify_integrity": True} if integrity else {}))
    dist.barrier()
    if rank == 0:
        _write_tracker(root, str(iteration))
    return sorted(os.listdir(ckdir))


def save_fsdp_dcp(rank, world, root, iteration=20, local_bias_index=False):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ckdir = os.path.join(root, "iter_{:07d}".format(iteration))
    if rank == 0:
        os.makedirs(ckdir, exist_ok=True)
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(8, 4)
    model = {"decoder.layers.0.self_attention.linear_qkv.weight": distribute_tensor(full, mesh, [Shard(0)])}
    torch.manual_seed(rank + 1)
    for local in range(2):
        g = rank * 2 + local
        model[f"decoder.layers.0.mlp.experts.linear_fc1.weight{g}"] = torch.randn(4, 4)
        b = local if local_bias_index else g  # the expert-keys bug keeps the local index for biases
        model[f"decoder.layers.0.mlp.experts.linear_fc1.bias{b}"] = torch.full((4,), float(g))
    state = {
        "model": model,
        "rng_state": {"(0, 0)": [{"random_rng_state": random.getstate()}]},
        "checkpoint_version": 3.0,
        "iteration": iteration,
    }
    dcp.save(state, checkpoint_id=ckdir)
    dist.barrier()
    if rank == 0:
        _write_tracker(root, str(iteration))
    return sorted(os.listdir(ckdir))


def megatron_args(tp, pp, ep, with_distributed_optimizer=False):
    """The args Namespace a legacy checkpoint pickles: megatron.training's own where it imports."""
    import torch

    try:
        import sys

        from megatron.training.arguments import parse_args

        argv = sys.argv
        sys.argv = [
            "pretrain_gpt.py",
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            "--expert-model-parallel-size",
            str(ep),
            "--ckpt-format",
            "torch",
        ]
        try:
            args = parse_args()
        finally:
            sys.argv = argv
        args.params_dtype = torch.bfloat16  # set by validate_args, which needs CUDA
    except ImportError:  # 0.16 wheels have no megatron.training; 0.18 needs PyYAML for it
        from megatron.core.transformer.enums import AttnBackend

        args = argparse.Namespace(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            ckpt_format="torch",
            params_dtype=torch.bfloat16,
            attention_backend=AttnBackend.auto,
            exit_signal=signal.SIGTERM,
            use_distributed_optimizer=False,
            no_save_optim=None,
        )
    args.use_distributed_optimizer = with_distributed_optimizer
    return args


def checkpoint_name(root, iteration, tp_rank, pp_rank, ep_rank, pp, ep):
    try:
        from megatron.training.checkpointing import get_checkpoint_name
    except ImportError:
        # The rule of get_checkpoint_name in 0.17.1, 0.18.2 and 0.19.2 (identical in the three).
        name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
        return os.path.join(root, "iter_{:07d}".format(iteration), name, "model_optim_rng.pt")
    return get_checkpoint_name(
        root,
        iteration,
        pipeline_parallel=pp > 1,
        tensor_rank=tp_rank,
        pipeline_rank=pp_rank,
        expert_parallel=ep > 1,
        expert_rank=ep_rank,
    )


def save_legacy(root, tp, pp, ep, iteration=100, with_args=True, weight_numel=16):
    """Every rank's model_optim_rng.pt as megatron.training writes ckpt_format 'torch' (state dict shape)."""
    import numpy as np
    import torch

    args = megatron_args(tp, pp, ep) if with_args else None
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                path = checkpoint_name(root, iteration, t, p, e, pp, ep)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                sd = {
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                    "model": {"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(weight_numel)},
                    "rng_state": [
                        {
                            "random_rng_state": random.getstate(),
                            "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(),
                            "cuda_rng_state": torch.get_rng_state(),
                            "rng_tracker_states": {},
                        }
                    ],
                }
                if with_args:
                    sd["args"] = args
                torch.save(sd, path)
    _write_tracker(root, str(iteration))
    return os.path.join(root, "iter_{:07d}".format(iteration))
