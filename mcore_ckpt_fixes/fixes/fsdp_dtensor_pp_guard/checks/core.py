"""fsdp-dtensor-pp-guard's round trip: ``megatron.training``'s own ``save_checkpoint`` and
``load_checkpoint`` in the ``fsdp_dtensor`` format on 2 gloo ranks: a 2-layer GPT saved with PP=1
(DP=2), loaded with PP=2 (stage 1 holds global layer 1 as its ``decoder.layers.0``), then with
PP=1 again.

Megatron-FSDP itself is stood in for, because it allocates its parameter and gradient buffers on a
CUDA device: the model is Megatron's plain DDP, and the run's arguments say ``use_megatron_fsdp``
(set after ``validate_args``, which refuses the format without it) so that the load takes the
release's ``fsdp_dtensor`` path (``_get_checkpoint_format``); ``strict_fsdp_dtensor_load`` is off,
since a plain model writes no ``_extra_state`` entries. The keys, DCP's save and load and the
release's preprocessing are the release's own. No optimizer or RNG state: the layer weights are what
the guard is about.

Phases: ``save``; ``load`` (PP=2; with the fix the refusal, one ``ValueError`` line, is recorded as
``refusal`` and the scenario goes on); ``layers`` (without the fix: stage 1's first layer compared
with the checkpoint's layers, one ``AssertionError`` line on every rank when it holds layer 0);
``same layout`` (PP=1 again: every layer weight equals what was saved, ``max_delta``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....testing import gpt_job as job
from ....testing.job_config import Config
from ....testing.result import RoundTrip
from ....testing.states import fix_states
from .. import ID, MODULE

NO_STATE = ("--no-save-optim", "--no-load-optim", "--no-save-rng", "--no-load-rng")
PP1 = Config("fsdp-dtensor-pp1", "dense GPT, DP=2", world=2, distributed_optimizer=False, extra_args=NO_STATE)
PP2 = Config(
    "fsdp-dtensor-pp2",
    "dense GPT, PP=2",
    world=2,
    distributed_optimizer=False,
    extra_args=NO_STATE + ("--pipeline-model-parallel-size", "2"),
)


def prepare():
    """Import in the parent what every rank uses, once."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401


def _start(cfg, ckpt_dir, pp):
    """The run's arguments (fsdp_dtensor, as a Megatron-FSDP run has them), its parallel state and model."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.training import arguments, global_vars

    mpu.destroy_model_parallel()
    global_vars.unset_global_variables()
    args = job.parse_args(cfg, ckpt_dir, 2)
    args.ckpt_format, args.use_megatron_fsdp, args.strict_fsdp_dtensor_load = "fsdp_dtensor", True, False
    mpu.initialize_model_parallel(pipeline_model_parallel_size=pp)
    job.seed(args)
    config = arguments.core_transformer_config_from_args(args)
    gpt = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(),
    )
    if torch.cuda.is_available():  # as the job's models: on the rank's GPU where there is one
        gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    return DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))


def _layers(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters() if ".layers." in n}


def _overwritten(model):
    with torch.no_grad():
        for p in model.module.parameters():
            p.fill_(7.0)
    return model


def _first_layer_holds(model, saved, stage):
    """Which saved layer this stage's ``decoder.layers.0`` output projection equals (its own
    global layer ``stage``, or layer 0), as the world sees it."""
    name = "module.decoder.layers.0.self_attention.linear_proj.weight"
    got = dict(model.module.named_parameters())[name]
    own = torch.equal(got, saved[name.replace(".layers.0.", f".layers.{stage}.")])
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (stage, own, torch.equal(got, saved[name])))
    return seen


def round_trip(rank, world_size, ckpt_dir, patched, device="cpu"):
    from megatron.core import parallel_state as mpu
    from megatron.training import checkpointing

    rt = RoundTrip(case="pp1_to_pp2", sharding_type="fsdp_dtensor", steps=None)
    with rt.running(), job.worker(PP1, device):
        rt.phase("precondition")
        rt["fix_state"] = fix_states(ID, (MODULE,), patched)
        rt.phase("save")
        model = _start(PP1, ckpt_dir, 1)
        rt["device"] = str(next(model.parameters()).device)
        saved = _layers(model)
        checkpointing.save_checkpoint(1, [model], None, None, 0)
        rt.phase("load")
        model = _overwritten(_start(PP2, ckpt_dir, 2))
        rt["refusal"] = None
        try:
            job.load(checkpointing.load_checkpoint, model, None, None)
        except ValueError as exc:
            rt["refusal"] = str(exc).replace(ckpt_dir, "CKPT")
        if rt["refusal"] is None:
            rt.phase("layers")
            seen = _first_layer_holds(model, saved, mpu.get_pipeline_model_parallel_rank())
            if any(stage > 0 and not own and layer0 for stage, own, layer0 in seen):
                raise AssertionError(
                    "stage 1's decoder.layers.0 (global layer 1) holds the checkpoint's layer 0 after a PP=2 "
                    "load of a PP=1 checkpoint"
                )
        rt.phase("same layout")
        model = _overwritten(_start(PP1, ckpt_dir, 1))
        iteration, _ = job.load(checkpointing.load_checkpoint, model, None, None)
        assert iteration == 1, iteration
        rt.compare(saved, _layers(model))
    return rt.result
