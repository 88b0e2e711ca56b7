"""Stand-in for Megatron-LM 0.18's gpt_builders.py: gpt_builder builds the decoder block spec
(MoE layers follow --moe-layer-freq), then the MTP block spec from the last of the decoder's stock
layer specs (not from the decoder block spec), then GPTModel. Trimmed to Megatron's local layers."""

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.training.arguments import core_transformer_config_from_args


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec_args = {"use_transformer_engine": use_te, "normalization": args.normalization, "qk_l2_norm": args.qk_l2_norm}
    transformer_layer_spec = get_gpt_decoder_block_spec(config, vp_stage=vp_stage, **spec_args)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        last_layer_spec = get_gpt_decoder_layer_specs(config, vp_stage=vp_stage, **spec_args)[-1]
        mtp_block_spec = get_gpt_mtp_block_spec(config, last_layer_spec, use_transformer_engine=use_te,
                                                vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    return model
