#!/usr/bin/env python3
"""Pretrain a DeepSeek-V3-style MoE GPT with Megatron (megatron-core 0.19) and, with
--moe-fp4-dispatch, MXFP4 token dispatch in every MoE layer.

    torchrun --nproc-per-node 2 scripts/pretrain_gpt_fp4.py <Megatron flags> [--moe-fp4-dispatch]
    python scripts/pretrain_gpt_fp4.py --help        # Megatron's flags and ours (group megatron_fp4)

The wheel ships megatron.training but no pretrain_gpt.py; this file is our counterpart of it:
- flags: Megatron's parser plus ours (`add_fp4_args`); an FP4 configuration the dispatcher cannot
  serve stops the run right after argument validation, with one sentence, before any GPU work;
- model: `GPTModel` with the decoder spec of `get_gpt_decoder_block_spec`, so --num-experts,
  --moe-layer-freq (e.g. "[0]+[1]*5": first layer dense), --moe-router-topk,
  --moe-shared-expert-intermediate-size and the router flags take effect as in Megatron. Transformer
  Engine specs are used when `transformer_engine` imports and --transformer-impl asks for them,
  otherwise Megatron's local (plain PyTorch) specs. --mtp-num-layers adds multi-token prediction
  layers built on the decoder's last layer spec; with the flag on, their MoE layers dispatch in FP4
  too;
- data: --mock-data or indexed datasets (--data-path / --train-data-path ...), with Megatron's
  tokenizer flags (--tokenizer-type NullTokenizer --vocab-size N for mock data);
- loss: masked next-token cross entropy, reported as "lm loss", averaged over tokens.
- memory cap: with MEGATRON_FP4_GPU_MEMORY_CAP_GIB=N in the environment (scripts/launch.py
  --enforce-memory-cap sets it from cluster.gpu_memory_gib) each process caps PyTorch's CUDA
  allocator on its GPU at N GiB before its first CUDA allocation; past it, torch.OutOfMemoryError.
Not handled here: context parallelism (batches are not sliced per CP rank; refused) and Megatron's
--yaml-cfg (it replaces every flag, ours included).
"""

import os
import re
import sys
import warnings
from functools import partial

# Run from a plain checkout too: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.backends import HAVE_APEX  # without apex, local layer norm is torch's
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

from megatron_fp4.integration import (
    FP4DispatchOptions,
    FP4DispatchUnsupported,
    add_fp4_args,
    check_fp4_dispatch_supported,
    count_fp4_moe_layers,
    use_fp4_dispatch,
    use_fp8_experts,
)
from megatron_fp4.experts import FP8Experts
from megatron_fp4.run_config import GPU_MEMORY_CAP_ENV


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except ImportError:
        return False


HAVE_TE = _importable("transformer_engine")
# Kernels that some default-on Megatron options need; none ships with the megatron-core wheel.
HAVE_APEX_GRAD_ACCUM = _importable("fused_weight_gradient_mlp_cuda")
HAVE_FUSED_SOFTMAX = _importable("scaled_masked_softmax_cuda")


def use_prebuilt_dataset_helpers():
    """Megatron's initialize runs `make` in megatron/core/datasets to build its C++ index helpers;
    the wheel ships them compiled but without the Makefile, so that step fails: skip it when the
    compiled helpers import."""
    if _importable("megatron.core.datasets.helpers_cpp"):
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = lambda: None


def add_launcher_args(parser):
    """Megatron's extra_args_provider: our flags, plus defaults that fit this machine."""
    # Megatron 0.19.2 has a help string with a bare '%' that makes argparse's --help crash.
    formatter = parser._get_formatter()
    for action in parser._actions:
        try:
            formatter._expand_help(action)
        except (ValueError, TypeError):
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    # Without Transformer Engine / apex some Megatron defaults name kernels that are not installed:
    # default to what runs here (explicit flags still win) and say so at the end of --help.
    changed = {}
    if not HAVE_TE:
        changed.update(transformer_impl="local", apply_rope_fusion=False)
        if not HAVE_APEX_GRAD_ACCUM:
            changed.update(gradient_accumulation_fusion=False)
    if not HAVE_APEX:
        changed.update(no_persist_layer_norm=True)
    if not HAVE_FUSED_SOFTMAX:
        changed.update(masked_softmax_fusion=False)
    cap_note = (f"Environment: {GPU_MEMORY_CAP_ENV}=N caps this process's CUDA memory (PyTorch's caching "
                "allocator) at N GiB before the first allocation; past it, torch.OutOfMemoryError.")
    if changed:
        parser.set_defaults(**changed)
        cap_note += (" Defaults changed by this launcher because Transformer Engine / apex kernels are not "
                     "installed here: " + ", ".join(f"{k}={v}" for k, v in changed.items()) + ".")
    parser.epilog = cap_note
    return add_fp4_args(parser)


def build_specs(args, config, vp_stage=None):
    """This stage's decoder block spec and the MTP block spec (None without --mtp-num-layers), with
    every MoELayer dispatching in FP4 when --moe-fp4-dispatch is on."""
    use_te = HAVE_TE and args.transformer_impl == "transformer_engine"
    spec_kwargs = {"use_transformer_engine": use_te, "normalization": args.normalization, "qk_l2_norm": args.qk_l2_norm}
    options = FP4DispatchOptions.from_args(args)  # None unless --moe-fp4-dispatch

    def ours(spec):
        # use_fp4_dispatch swaps every MoELayer for ours; use_fp8_experts their experts (--moe-fp4-experts fp8).
        return use_fp8_experts(use_fp4_dispatch(spec, options), args.moe_fp4_experts)

    # Dense / MoE layers follow --moe-layer-freq.
    decoder_spec = ours(get_gpt_decoder_block_spec(config, vp_stage=vp_stage, **spec_kwargs))
    mtp_spec = None
    if args.mtp_num_layers:
        # MTP layers copy the decoder's last layer (MoE in DeepSeek-V3), taken from the full
        # layer list because this stage's slice of the decoder may be empty.
        last_layer = get_gpt_decoder_layer_specs(config, **spec_kwargs)[-1]
        mtp_spec = get_gpt_mtp_block_spec(
            config, ours(last_layer), use_transformer_engine=use_te, vp_stage=vp_stage
        )
    return decoder_spec, mtp_spec


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build this pipeline stage's GPTModel (called by Megatron's get_model)."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    decoder_spec, mtp_spec = build_specs(args, config, vp_stage)
    model = GPTModel(
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
    print_rank_0(f"> MoE layers dispatching in MXFP4 on this stage: {count_fp4_moe_layers(model)}; "
                 f"with FP8 experts: {sum(isinstance(m, FP8Experts) for m in model.modules())}")
    return model


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Mock or indexed GPT datasets, built on every rank (each rank then reads its own batches)."""
    args = get_args()
    blend, blend_per_split = (None, None) if args.mock_data else get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
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
    print_rank_0(f"> building {dataset_type.__name__} train, validation and test splits")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()


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


def refuse(sentence):
    """Stop before any GPU work with exit status 2 (argparse's). Every rank prints the sentence:
    torchrun kills the other ranks as soon as the first one exits, so rank 0 alone may never get to."""
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    sys.exit(2)


# A config states the GPU's nominal size (80 for an "80 GB" H100), which the device reports a few %
# lower (79.2 GiB): within this margin the cap means "the whole GPU".
NOMINAL_SIZE_MARGIN = 1.03


def memory_fraction(cap_gib: float, total_bytes: int) -> float:
    """The share of a GPU's `total_bytes` that `cap_gib` GiB is (set_per_process_memory_fraction's unit);
    1.0 for a cap up to NOMINAL_SIZE_MARGIN above the GPU's size."""
    if not cap_gib > 0:  # also refuses NaN
        raise ValueError(f"the cap must be a positive number of GiB, got {cap_gib}")
    cap_bytes = cap_gib * 2**30
    if cap_bytes > NOMINAL_SIZE_MARGIN * total_bytes:
        raise ValueError(f"a {cap_gib:g} GiB cap is more than this GPU's {total_bytes / 2**30:.1f} GiB")
    return min(cap_bytes / total_bytes, 1.0)


def apply_memory_cap(local_rank: int) -> None:
    """With GPU_MEMORY_CAP_ENV set, cap PyTorch's allocator on this process's GPU; call it before the
    first CUDA allocation. The cap bounds what the allocator reserves, not the CUDA context or NCCL."""
    text = os.environ.get(GPU_MEMORY_CAP_ENV)
    if not text:
        return
    if not torch.cuda.is_available():
        refuse(f"{GPU_MEMORY_CAP_ENV}={text} caps CUDA memory, but no CUDA GPU is visible.")
    total_bytes = torch.cuda.get_device_properties(local_rank).total_memory
    try:
        cap_gib = float(text)
        fraction = memory_fraction(cap_gib, total_bytes)
    except ValueError as err:
        refuse(f"{GPU_MEMORY_CAP_ENV}={text}: {err}.")
    torch.cuda.set_device(local_rank)  # the GPU Megatron picks later; keeps this rank's context off GPU 0
    torch.cuda.set_per_process_memory_fraction(fraction, local_rank)
    whole = " (its nominal size: the whole GPU)" if fraction == 1.0 else ""
    print(f"rank {os.environ.get('RANK', '0')}: capping this process's CUDA memory at {cap_gib:g} GiB of "
          f"{total_bytes / 2**30:.1f} GiB{whole} (GPU {local_rank}, {GPU_MEMORY_CAP_ENV})", flush=True)


def parse_launcher_args():
    """Megatron's parse + validate (which also sets its globals: args, tokenizer, timers)."""
    # Megatron 0.19.2 divides by --eval-interval even when it is unset; unset means "no evaluation
    # during training" (its help), so default it past any run length.
    return parse_and_validate_args(add_launcher_args, args_defaults={"eval_interval": 2**31 - 1})


def main():
    args = parse_launcher_args()
    try:
        check_fp4_dispatch_supported(args)
    except FP4DispatchUnsupported as err:
        refuse(str(err))
    if args.context_parallel_size > 1:
        refuse("this launcher does not slice batches for context parallelism: use --context-parallel-size 1.")
    apply_memory_cap(args.local_rank)

    use_prebuilt_dataset_helpers()
    with warnings.catch_warnings():  # it recommends a model config; we pass a model provider
        warnings.simplefilter("ignore")
        cfg = pretrain_cfg_container_from_args(args)
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
