"""Reproductions of catalogued bugs that no fix covers and that need a GPU (run by ``pytest -m gpu``,
tests/gpu/test_cuda_known_bugs.py; test and selftest worker processes only).

``mfsdp_no_load_optim`` (catalogue ``mfsdp-reload-model-params-not-implemented``): a bf16 GPT built
by ``megatron.training``'s own ``get_model`` with ``--use-megatron-fsdp`` (Megatron-FSDP's
``FullyShardedDataParallel``, whose parameter and gradient buffers live on the GPU), the distributed
optimizer, saved by ``save_checkpoint`` in ``fsdp_dtensor``; then a new model and optimizer load it
with ``--no-load-optim`` (as a fine-tuning run or a run that resets its optimizer does). From 0.18.0
``load_checkpoint`` asks the optimizer to copy the loaded model weights into its fp32 main
parameters (``reload_model_params``), which the distributed optimizer refuses under Megatron-FSDP
with ``NotImplementedError``; on 0.17 the load completes and every parameter is what was saved.

One rank on one GPU (NCCL; Megatron-FSDP's collectives need it, DP=1 keeps the buffers whole). On a
CPU host the same code runs up to Megatron-FSDP's wrapper, which refuses a model without a CUDA
device (phase ``build``): tests/test_gpu_collection.py checks that everything before it resolves.
"""

from __future__ import annotations

import torch

from . import gpt_job as job
from .job_config import Config
from .result import RoundTrip

MFSDP = Config(
    "mfsdp-bf16",
    "dense GPT, Megatron-FSDP, bf16, fsdp_dtensor",
    world=1,
    ckpt_format="fsdp_dtensor",
    extra_args=("--use-megatron-fsdp", "--no-save-rng", "--no-load-rng"),
)


def _provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **_):
    """The model provider ``get_model`` calls (its keyword arguments differ between releases)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import arguments, get_args

    args = get_args()
    config = config or arguments.core_transformer_config_from_args(args)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
    )


def _build(args):
    """Model (``get_model``: Megatron-FSDP's wrapper), distributed optimizer and scheduler."""
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import get_model, get_optimizer_param_scheduler

    model = get_model(_provider)
    optimizer = get_megatron_optimizer(job.optimizer_config(args), model)
    return model, optimizer, get_optimizer_param_scheduler(optimizer)


def _weights(model):
    """Every parameter's values (Megatron-FSDP's are DTensors: with DP=1 their local part is whole)."""
    out = {}
    for name, p in model[0].named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().float().clone()
    return out


def mfsdp_no_load_optim(rank, world_size, ckpt_dir, patched=False, device="cuda"):
    """Save with Megatron-FSDP, load with ``--no-load-optim``: the release's outcome (no fix here;
    ``patched`` is accepted for the launcher's signature and ignored)."""
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing

    rt = RoundTrip(case="no_load_optim", sharding_type="fsdp_dtensor", steps=None)
    with rt.running(), job.worker(MFSDP, device):
        rt.phase("arguments")
        args = job.parse_args(MFSDP, ckpt_dir, 1)
        mpu.initialize_model_parallel()
        job.seed(args)
        rt.phase("build")
        model, optimizer, scheduler = _build(args)
        rt["device"] = str(next(model[0].parameters()).device)
        saved = _weights(model)
        rt.phase("save")
        checkpointing.save_checkpoint(1, model, optimizer, scheduler, 0)
        torch.distributed.barrier()
        rt.phase("build")
        model, optimizer, scheduler = _build(args)
        with torch.no_grad():
            for p in model[0].parameters():
                p.fill_(7.0)
        args.no_load_optim = True
        rt.phase("load")
        job.load(checkpointing.load_checkpoint, model[0], optimizer, scheduler)
        rt.compare(saved, _weights(model))
    return rt.result
