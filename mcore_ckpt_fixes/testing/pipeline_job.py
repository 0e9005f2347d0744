"""The resume-check GPT built and stepped with Megatron's pipeline schedule (PP > 1, interleaved
where the configuration has virtual stages): :func:`.gpt_job.start` builds a pipeline configuration
here and :func:`.gpt_job.train_steps` steps its model chunks here; everything else (arguments,
seeds, checkpoint calls, snapshot, the phases) is :mod:`.gpt_job`'s.

Built and trained as ``megatron.training`` builds and trains it:
``megatron.training.training.get_model`` (pre/post process and virtual stages as Megatron sets
them, ``Float16Module``, Megatron's DDP, tied embeddings on the first and last stage),
``get_megatron_optimizer`` over every model chunk, and each step ``get_forward_backward_func()``
(1F1B; interleaved with virtual stages) inside the rerun state machine with
``RerunDataIterator`` s, ``finalize_model_grads`` as the schedule's gradient finaliser (the
data-parallel reduce-scatter and the tied embedding's all-reduce between first and last stage).
Pipeline p2p runs on gloo unchanged: the CPU stand-ins are :func:`.gpt_job.worker`'s.

Every rank draws its batch and its tracker streams each micro-batch and step, as the PP=1 job does,
whatever its stage: a stage that does not use them still checkpoints and restores them. The loss
per step is recorded on the last stage; every rank also records the step's gradient norm (the same
on all ranks: it sums every stage's gradients), so that a middle stage's resumed steps are compared
too.

0.17's interleaved schedule frees a stage's output (``deallocate_pipeline_outputs``, on in every
``megatron.training`` run) before its asynchronous send to the next stage has completed; 0.18 and
0.19 wait for the send first. On gloo two identical interleaved runs on 0.17 then differ from their
first step (measured on 0.17.1: the run that never resumes already differs from the release's own).
That is the release's training, not its checkpoint: on those releases the job keeps its outputs
(:data:`FREES_OUTPUTS_BEFORE_SEND`), so that runs are comparable at all.
"""

from __future__ import annotations

import functools

from . import gpt_job as job

# Releases whose interleaved schedule frees an output before its send completed (module doc).
FREES_OUTPUTS_BEFORE_SEND = "<0.18"


def _keeps_outputs(cfg) -> bool:
    from packaging.specifiers import SpecifierSet

    from ..engine.version import detect

    version = detect().version
    return (
        bool(cfg.vpp) and version is not None and version in SpecifierSet(FREES_OUTPUTS_BEFORE_SEND, prereleases=True)
    )


def model_provider(args, cfg, pre_process=True, post_process=True, vp_stage=None, **_):
    """``pretrain_gpt``'s model provider for the job's GPT: one stage's (virtual) chunk."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import arguments

    config = arguments.core_transformer_config_from_args(args)
    if _keeps_outputs(cfg):
        config.deallocate_pipeline_outputs = False
    if cfg.megatron_argv:  # a user's own job: its model as pretrain_gpt builds it
        from .own_model import gpt

        return gpt(args, config, pre_process, post_process, vp_stage)
    spec = get_gpt_layer_local_spec(num_experts=cfg.ep or None, moe_grouped_gemm=False)
    where = {"vp_stage": vp_stage} if vp_stage is not None else {}
    return GPTModel(
        config,
        spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        # Tied, as pretrain_gpt ties them unless --untie-embeddings-and-output-weights: the last
        # stage's output layer is a copy of the first stage's word embedding, kept equal through the
        # embedding group, each in a gradient bucket of its own.
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        **where,
    )


def build(args, cfg):
    """Model chunks, optimizer and scheduler as ``setup_model_and_optimizer`` builds them, and the
    chunks' config set up as ``megatron.training``'s ``train`` sets it before the first step."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.utils import get_model_config
    from megatron.training.training import get_model, get_optimizer_param_scheduler

    model = get_model(functools.partial(model_provider, args, cfg))
    optimizer = get_megatron_optimizer(job.optimizer_config(args), model)
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:  # the schedule starts each chunk's reduction as its backward ends
        config.no_sync_func = _per_chunk([chunk.no_sync for chunk in model])
        if args.align_grad_reduce:
            config.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in model])
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, get_optimizer_param_scheduler(optimizer)


def _per_chunk(funcs):
    """As ``train`` sets the schedule's hooks: one per model chunk, or the one where there is one."""
    return funcs[0] if len(funcs) == 1 else funcs


def _batches(cpu_gen):
    """Endless micro-batches of the PP=1 job's sample (:func:`.gpt_job.batch`)."""
    while True:
        yield tuple(t.to(job.rank_device()) for t in job.batch(cpu_gen))


def data_iterators(model, cpu_gen):
    """One ``RerunDataIterator`` per model chunk, all drawing from this rank's one stream of
    samples (as Megatron's one loader feeds every virtual stage)."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    source = _batches(cpu_gen)
    iterators = [RerunDataIterator(source) for _ in model]
    return iterators if len(iterators) > 1 else iterators[0]


def _forward_step(scale, data_iterator, model):
    tokens, position_ids, mask, labels = next(data_iterator)
    output = model(tokens, position_ids, mask, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean() * scale
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train_step(model, optimizer, scheduler, args, iterators):
    """One step as ``megatron.training.training.train_step`` takes it: (the last stage's loss or
    None, the step's gradient norm)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    scale = job.loss_scale()  # every tracker stream, on every rank, once per step
    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(iterators):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=functools.partial(_forward_step, scale),
            data_iterator=iterators,
            model=model,
            num_microbatches=get_num_microbatches(),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length,
            forward_only=False,
        )
    ok, grad_norm, _ = optimizer.step()
    # fp16's dynamic loss scale skips the steps that overflow (the first ones, while the scale comes
    # down): megatron.training then leaves the scheduler where it is. Any other skip is not expected.
    assert ok or args.fp16, "the optimizer skipped a step (overflow): the run would not be comparable"
    if ok:
        scheduler.step(increment=args.global_batch_size)
    loss = float(sum(r["loss"] for r in reduced)) if reduced else None
    return loss, None if grad_norm is None else float(grad_norm)
