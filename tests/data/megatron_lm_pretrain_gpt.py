"""Stand-in for a user's Megatron-LM pretrain_gpt.py (the megatron-core wheel ships none), written
for tests/launch/test_user_pretrain_gpt.py: the same structure, trimmed. model_provider builds the decoder
block spec (MoE layers follow --moe-layer-freq), the MTP block spec from it, then GPTModel; the
datasets provider and forward_step feed Megatron's pretrain(); the main block parses and validates
the arguments, builds the config container and calls pretrain(). The test copies this file and adds
megatron_fp4.launch's three lines to the copy."""

from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        transformer_layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
    else:
        transformer_layer_spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm)
    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        mtp_block_spec = get_gpt_mtp_block_spec(
            config, transformer_layer_spec, use_transformer_engine=use_te, vp_stage=vp_stage
        )
    return GPTModel(
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
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None, split=None,
        path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True, config).build()


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def forward_step(data_iterator, model):
    batch = {key: value.cuda(non_blocking=True) for key, value in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(
        extra_args_provider=None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    full_config = pretrain_cfg_container_from_args(args)
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
