"""The GPT model, data and loss our launcher hands to Megatron's pretrain(): Megatron-LM's
pretrain_gpt.py counterpart (the wheel ships none), with the MoE layers as our flags ask."""

from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_blend_and_blend_per_split

from ..integration import use_fp4
from ..options import FP4Options
from .data_order import data_seed, validation_identity_line
from .installed import HAVE_TE


def layer_spec(spec, args=None):
    """`spec` (a layer, decoder block or MTP block spec; None stays None) with the MoE layers our
    flags ask for: use_fp4 with the options of `args` (default: Megatron's parsed arguments). Each
    FP4MoELayer validates the configuration again when built."""
    return use_fp4(spec, FP4Options.from_args(get_args() if args is None else args))


def build_specs(args, config, vp_stage=None):
    """This stage's decoder block spec and the MTP block spec (None without --mtp-num-layers)."""
    use_te = HAVE_TE and args.transformer_impl == "transformer_engine"
    spec_kwargs = {"use_transformer_engine": use_te, "normalization": args.normalization, "qk_l2_norm": args.qk_l2_norm}
    # Dense / MoE layers follow --moe-layer-freq.
    decoder_spec = layer_spec(get_gpt_decoder_block_spec(config, vp_stage=vp_stage, **spec_kwargs), args)
    mtp_spec = None
    if args.mtp_num_layers:
        # MTP layers copy the decoder's last layer (MoE in DeepSeek-V3), taken from the full
        # layer list because this stage's slice of the decoder may be empty.
        last_layer = get_gpt_decoder_layer_specs(config, **spec_kwargs)[-1]
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec(last_layer, args), use_transformer_engine=use_te,
                                          vp_stage=vp_stage)
    return decoder_spec, mtp_spec


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this pipeline stage's GPTModel (called by Megatron's get_model)."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    decoder_spec, mtp_spec = build_specs(args, config, vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        vocab_size=args.padded_vocab_size,
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
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=mtp_spec,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock or indexed GPT datasets, built on every rank (each rank then reads its own batches); the
    datasets' seed is data_order.data_seed (--seed unless MEGATRON_FP4_DATA_SEED is set)."""
    args = get_args()
    blend, blend_per_split = (None, None) if args.mock_data else get_blend_and_blend_per_split(args)
    seed = data_seed(args)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if args.mock_data else args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test splits, data seed {seed}")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()
    if args.full_validation and not args.mock_data and datasets[1] is not None:
        print_rank_0(validation_identity_line(datasets[1]))
    return datasets


# Every rank builds its data loader: no broadcast of batches inside the tensor-parallel group.
train_valid_test_datasets_provider.is_distributed = True


def get_batch(data_iterator):
    """Next micro-batch on this GPU: tokens, labels, loss_mask, position_ids (+ attention_mask)."""
    batch = next(data_iterator)
    return {key: value.cuda(non_blocking=True) for key, value in batch.items()}


def loss_func(loss_mask, output_tensor):
    """Sum of masked token losses, the token count, and [sum, count] for Megatron's report."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    if args.check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(
            result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss calculation",
            tolerance=0.0, fatal=True,
        )
    report = torch.stack([loss.detach(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch forward; Megatron's schedule calls loss_func on the last pipeline stage."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
        labels=batch["labels"], loss_mask=batch["loss_mask"],
    )
    return output, partial(loss_func, batch["loss_mask"])
