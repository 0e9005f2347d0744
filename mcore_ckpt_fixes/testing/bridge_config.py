"""Megatron-Bridge's own config objects for the worlds that checkpoint through Bridge's functions
(test and selftest worker processes only; imports Bridge when called)."""

from __future__ import annotations

# A GPT Bridge builds on the CPU: initialised there, and none of the fused kernels (Transformer
# Engine's, Apex's) that a CPU host lacks.
CPU_GPT_FIELDS = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
)


def cpu_gpt_provider(**fields):
    """Bridge's ``GPTModelProvider`` with ``fields`` on the CPU, finalised (Bridge defers
    ``TransformerConfig.__post_init__``, init methods and all, to ``finalize``)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    model = GPTModelProvider(**fields, **CPU_GPT_FIELDS)
    model.finalize()
    return model


def round_trip_config(model, ckpt_dir, ckpt_format, rng):
    """Bridge's own ``ConfigContainer``, its defaults but for what a checkpoint round trip of
    ``model`` needs: one step's batch, no distributed optimizer, no optimizer state saved or loaded,
    the RNG state saved and loaded when ``rng``."""
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        LoggerConfig,
        OptimizerConfig,
        SchedulerConfig,
        TrainingConfig,
    )
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    return ConfigContainer(
        train=TrainingConfig(micro_batch_size=1, global_batch_size=2, train_iters=1),
        model=model,
        optimizer=OptimizerConfig(lr=0.1, use_distributed_optimizer=False),
        scheduler=SchedulerConfig(),
        dataset=None,
        logger=LoggerConfig(),
        tokenizer=TokenizerConfig(),
        checkpoint=CheckpointConfig(
            save=ckpt_dir,
            load=ckpt_dir,
            ckpt_format=ckpt_format,
            save_interval=1,
            save_optim=False,
            load_optim=False,
            save_rng=rng,
            load_rng=rng,
        ),
    )
