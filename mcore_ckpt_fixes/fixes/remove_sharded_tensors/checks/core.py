"""remove-sharded-tensors' round trip on one gloo rank: a ``torch_dist`` checkpoint saved with
``separation_hint="optimizer"`` (the optimizer's tensors in files of their own, as the removal needs)
loses its optimizer tensors through ``dist_checkpointing.remove_sharded_tensors(dir, "optimizer")``.
Compared: the model's tensors load back exactly; the checkpoint's metadata lists the model's keys
only; the optimizer's files are gone and no ``.metadata.tmp`` or ``.metadata.bck`` is left. On
0.19, where the release removes them itself, the outcome the fix is held to.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ....testing.dist_optimizer import values
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE, SERIALIZATION

MODEL = {"model.weight": (8, 4), "model.bias": (8,)}
OPTIMIZER = {"optimizer.exp_avg.weight": (8, 4), "optimizer.exp_avg.bias": (8,)}


def prepare() -> None:
    """In the parent of a forked world: the modules the ranks use."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401


def _sharded(shapes, seed):
    from megatron.core.dist_checkpointing import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, values(seed, k, shape=s)) for k, s in shapes.items()}


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import dist_checkpointing, parallel_state as mpu
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from torch.distributed.checkpoint import FileSystemReader

    rt = RoundTrip()
    path = os.path.join(ckpt_dir, "separated")
    with rt.running():
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE, SERIALIZATION), patched)
        mpu.initialize_model_parallel()
        rt.phase("save")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer")
        dist_checkpointing.save({**_sharded(MODEL, 1), **_sharded(OPTIMIZER, 2)}, path, strategy)
        rt["files_before"] = sorted(os.listdir(path))
        rt.phase("remove")
        if rank == 0:
            dist_checkpointing.remove_sharded_tensors(path, "optimizer")
        dist.barrier()
        rt["files_after"] = sorted(os.listdir(path))
        rt["keys_after"] = sorted(k for k in FileSystemReader(path).read_metadata().state_dict_metadata if "/" not in k)
        rt.phase("load")
        request = {k: v for k, v in _sharded(MODEL, 3).items()}
        loaded = dist_checkpointing.load(request, path)
        expected = {k: t.data for k, t in _sharded(MODEL, 1).items()}
        rt.compare(expected, {k: torch.as_tensor(loaded[k]) for k in MODEL})
    return rt.result
