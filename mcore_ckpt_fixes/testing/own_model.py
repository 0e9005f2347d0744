"""The GPT of a user's own job (``selftest --resume --megatron-args``), built from its arguments as
``pretrain_gpt``'s model provider builds it, with the layer specs it picks: the decoder block spec where the job has
experts (its MoE layer pattern, MLA, normalisation), the layer spec for a dense job; position embeddings, RoPE and tied embeddings as the arguments say."""

from __future__ import annotations


def spec(args, config, vp_stage):
    """The layer spec ``pretrain_gpt`` picks: Transformer Engine's where the job asks for it (on a
    GPU host; a CPU host's plan runs the local implementation), else Megatron's local layers."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        where = {"vp_stage": vp_stage} if vp_stage is not None else {}
        return specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm, **where
        )
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=None,
            moe_grouped_gemm=False,
            qk_layernorm=args.qk_layernorm,
            multi_latent_attention=args.multi_latent_attention,
            qk_l2_norm=args.qk_l2_norm,
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=None,
        moe_grouped_gemm=False,
        qk_layernorm=args.qk_layernorm,
        multi_latent_attention=args.multi_latent_attention,
        normalization=args.normalization,
        qk_l2_norm=args.qk_l2_norm,
    )


def gpt(args, config, pre_process=True, post_process=True, vp_stage=None):
    """One (virtual) stage's chunk of the job's GPT."""
    from megatron.core.models.gpt import GPTModel

    where = {"vp_stage": vp_stage} if vp_stage is not None else {}
    return GPTModel(
        config,
        spec(args, config, vp_stage),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        **where,
    )
