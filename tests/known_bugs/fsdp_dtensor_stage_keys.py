"""The world of tests/known_bugs/test_fsdp_dtensor_stage_keys.py (catalogue entry
``fsdp-dtensor-stage-local-layer-keys``, NVIDIA/Megatron-LM#7452, open).

``megatron.training``'s own ``save_checkpoint`` / ``load_checkpoint`` in the ``fsdp_dtensor`` format
on 2 gloo ranks: a 2-layer GPT saved with PP=1 (DP=2), then loaded with PP=2, where stage 1 holds
global layer 1 as its ``decoder.layers.0``. Megatron-FSDP itself is stood in for: it allocates its
parameter and gradient buffers on a CUDA device, so the model here is Megatron's plain DDP, and the
run's arguments say ``use_megatron_fsdp`` (set after ``validate_args``, which refuses the format
without it) so that the load takes the release's ``fsdp_dtensor`` path (``_get_checkpoint_format``);
``strict_fsdp_dtensor_load`` is off, since a plain model has no ``_extra_state`` entries to write.
The keys, the DCP save and load and the release's preprocessing are the release's own. No optimizer
or RNG state (``--no-save-optim``, ``--no-load-rng``): the layer weights are what the entry is about.

Returns per rank: its pipeline stage, and for each weight of its first layer whether it equals the
saved weights of the layer it holds (its global layer) and of global layer 0.
"""

from __future__ import annotations

import torch

EXTRA = ("--no-save-optim", "--no-load-optim", "--no-save-rng", "--no-load-rng")


def _args(cfg, ckpt_dir):
    from mcore_ckpt_fixes.testing import gpt_job as job

    args = job._args(cfg, ckpt_dir, 2)
    args.ckpt_format, args.use_megatron_fsdp, args.strict_fsdp_dtensor_load = "fsdp_dtensor", True, False
    return args


def _model(args):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.training import arguments

    config = arguments.core_transformer_config_from_args(args)
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
    )
    return DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), Float16Module(config, gpt)
    )


def save_pp1_load_pp2(rank, world_size, ckpt_dir, patched=False, device="cpu"):
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing, global_vars

    from mcore_ckpt_fixes.testing import gpt_job as job
    from mcore_ckpt_fixes.testing.job_config import Config

    pp1 = Config(
        "fsdp-dtensor-pp1",
        "dense GPT, DP=2",
        world=2,
        ckpt_format="torch_dist",
        distributed_optimizer=False,
        extra_args=EXTRA,
    )
    pp2 = Config(
        "fsdp-dtensor-pp2",
        "dense GPT, PP=2",
        world=2,
        ckpt_format="torch_dist",
        distributed_optimizer=False,
        extra_args=EXTRA + ("--pipeline-model-parallel-size", "2"),
    )
    with job.worker(pp1, device):
        args = _args(pp1, ckpt_dir)
        mpu.initialize_model_parallel()
        job._seed(args)
        model = _model(args)
        saved = {n: p.detach().clone() for n, p in model.module.named_parameters() if ".layers." in n}
        checkpointing.save_checkpoint(1, [model], None, None, 0)
        mpu.destroy_model_parallel()
        global_vars.unset_global_variables()
        args = _args(pp2, ckpt_dir)
        mpu.initialize_model_parallel(pipeline_model_parallel_size=2)
        job._seed(args)
        model = _model(args)
        with torch.no_grad():
            for p in model.module.parameters():
                p.fill_(7.0)
        iteration, _ = job._load(checkpointing.load_checkpoint, model, None, None)
        stage = mpu.get_pipeline_model_parallel_rank()
        weights = {}
        for name, p in model.module.named_parameters():
            if ".layers.0." in name and name.endswith("weight"):
                own = name.replace(".layers.0.", f".layers.{stage}.")
                weights[name] = {"own": bool(torch.equal(p, saved[own])), "layer0": bool(torch.equal(p, saved[name]))}
        return {"stage": stage, "iteration": iteration, "weights": weights}
