"""The model and its parallel layout, read from Megatron's parsed arguments: every size the
estimator multiplies, derived the way Megatron's own argument validation derives it (padded
vocabulary, kv_channels, query groups, MoE layer pattern, virtual pipeline stages from a layout).
"""

import math
from dataclasses import dataclass, field

# Layer kinds a pipeline chunk can hold, in the order the chunk runs them.
EMBEDDING, DENSE, MOE, MTP, LOSS = "embedding", "dense", "moe", "mtp", "loss"


class EstimateError(ValueError):
    """A configuration the estimator cannot model."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn_hidden: int
    num_layers: int
    heads: int
    query_groups: int
    head_dim: int  # kv_channels
    vocab: int  # padded
    seq_length: int
    micro_batch: int
    global_batch: int
    swiglu: bool
    untied_embeddings: bool
    norm_params: int  # 1 for RMSNorm (weight), 2 for LayerNorm (weight + bias)
    moe_pattern: tuple  # 1 = MoE layer, 0 = dense, one entry per decoder layer
    experts: int
    topk: int
    moe_ffn_hidden: int
    shared_ffn_hidden: int
    mtp_layers: int
    mla: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_rope_dim: int
    v_head_dim: int
    qk_layernorm: bool  # MLA: LayerNorms on the compressed q and kv (DeepSeek-V3 has them)
    te: bool  # Transformer Engine layers (fused attention, fused LayerNorm+Linear) vs Megatron's local ones
    # The core attention: fused (Transformer Engine's, or ours on local layers with
    # --moe-fp4-fused-attention: keeps its output and log-sum-exp) or Megatron's local
    # DotProductAttention (keeps the [b, heads, s, s] probabilities).
    fused_attention: bool
    grouped_gemm: bool = False  # --moe-grouped-gemm: the routed experts in one grouped module
    # Megatron's gradient-accumulation fusion: weight gradients added into main_grad (wgrad_buffers.py)
    wgrad_fusion: bool = False

    @property
    def mtp_is_moe(self) -> bool:
        return bool(self.moe_pattern and self.moe_pattern[-1])

    @property
    def fc1_factor(self) -> int:
        return 2 if self.swiglu else 1


@dataclass(frozen=True)
class Parallel:
    world: int
    tp: int
    pp: int
    vpp: int  # model chunks per pipeline rank (1 without virtual stages)
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    chunks: tuple = field(repr=False)  # chunks[pp_rank][chunk] = tuple of (kind, decoder layer index or None)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    @property
    def local_experts_divisor(self) -> int:
        return self.ep * self.etp


def _moe_pattern(args, num_layers: int) -> tuple:
    if not args.num_experts:
        return (0,) * num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, str):
        from megatron.training.arguments import moe_freq_type

        freq = moe_freq_type(freq)
    if isinstance(freq, int):
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    if len(freq) != num_layers:
        raise EstimateError(f"moe_layer_freq has {len(freq)} entries for {num_layers} layers")
    return tuple(int(bool(x)) for x in freq)


def model_shape(args) -> ModelShape:
    heads = args.num_attention_heads
    hidden = args.hidden_size
    head_dim = args.kv_channels or hidden // heads
    groups = args.num_query_groups if args.group_query_attention else heads
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    if not args.vocab_size:
        raise EstimateError("the estimator needs vocab_size in the config (the tokenizer is not loaded)")
    vocab = int(math.ceil(args.vocab_size / multiple) * multiple)
    experts = args.num_experts or 0
    return ModelShape(
        hidden=hidden,
        ffn_hidden=args.ffn_hidden_size or 4 * hidden,
        num_layers=args.num_layers,
        heads=heads,
        query_groups=groups,
        head_dim=head_dim,
        vocab=vocab,
        seq_length=args.seq_length,
        micro_batch=args.micro_batch_size,
        global_batch=args.global_batch_size or args.micro_batch_size,
        swiglu=bool(args.swiglu),
        untied_embeddings=bool(args.untie_embeddings_and_output_weights),
        norm_params=1 if args.normalization == "RMSNorm" else 2,
        moe_pattern=_moe_pattern(args, args.num_layers),
        experts=experts,
        topk=args.moe_router_topk if experts else 0,
        moe_ffn_hidden=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if experts else 0,
        shared_ffn_hidden=args.moe_shared_expert_intermediate_size or 0,
        mtp_layers=args.mtp_num_layers or 0,
        mla=bool(args.multi_latent_attention),
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_rope_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        qk_layernorm=bool(args.qk_layernorm),
        te=args.transformer_impl == "transformer_engine",
        fused_attention=args.transformer_impl == "transformer_engine" or bool(args.moe_fp4_fused_attention),
        grouped_gemm=bool(args.moe_grouped_gemm),
        wgrad_fusion=bool(args.gradient_accumulation_fusion),
    )


def _layout_stages(args, shape: ModelShape, pp: int) -> list[list]:
    """One list of layer kinds per pipeline stage (pp * vpp stages, stage s on rank s % pp)."""
    if args.pipeline_model_parallel_layout:
        from megatron.core.transformer.pipeline_parallel_layer_layout import (
            PipelineParallelLayerLayout,
        )

        stages = [[t.name for t in stage] for stage in
                  PipelineParallelLayerLayout.parse_str_to_list(args.pipeline_model_parallel_layout)]
        kinds = {"embedding": EMBEDDING, "loss": LOSS, "decoder": "t", "mtp": MTP}
        stages = [[kinds[t] for t in stage] for stage in stages]
        if len(stages) % pp:
            raise EstimateError(f"pipeline layout has {len(stages)} stages, not a multiple of PP {pp}")
        return stages
    vpp = 1
    if args.num_layers_per_virtual_pipeline_stage:
        vpp = shape.num_layers // (pp * args.num_layers_per_virtual_pipeline_stage)
    elif args.num_virtual_stages_per_pipeline_rank:
        vpp = args.num_virtual_stages_per_pipeline_rank
    n_stages = pp * vpp
    first = args.decoder_first_pipeline_num_layers
    last = args.decoder_last_pipeline_num_layers
    counts = [None] * n_stages
    rest, free = shape.num_layers, n_stages
    if first is not None:
        counts[0], rest, free = first, rest - first, free - 1
    if last is not None:
        counts[-1], rest, free = last, rest - last, free - 1
    if free and rest % free:
        raise EstimateError(f"{shape.num_layers} layers do not split evenly over {n_stages} pipeline stages; "
                            "give pipeline_model_parallel_layout or decoder_first/last_pipeline_num_layers")
    counts = [c if c is not None else rest // free for c in counts]
    stages = [["t"] * c for c in counts]
    stages[0].insert(0, EMBEDDING)
    stages[-1] += [MTP] * shape.mtp_layers + [LOSS]
    return stages


def parallel_layout(args, shape: ModelShape, world: int) -> Parallel:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep = args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    if world % (tp * pp * cp) or world % (etp * ep * pp):
        raise EstimateError(f"world size {world} is not a multiple of TP*PP*CP ({tp * pp * cp}) and ETP*EP*PP "
                            f"({etp * ep * pp}): check the config's cluster section")
    if shape.experts and shape.experts % ep:
        raise EstimateError(f"{shape.experts} experts do not split over EP {ep}")
    stages = _layout_stages(args, shape, pp)
    vpp = len(stages) // pp
    layer = 0
    numbered = []
    for stage in stages:
        out = []
        for kind in stage:
            if kind == "t":
                if layer >= shape.num_layers:
                    raise EstimateError("the pipeline layout holds more decoder layers than num_layers")
                out.append((MOE if shape.moe_pattern[layer] else DENSE, layer))
                layer += 1
            else:
                out.append((kind, None))
        numbered.append(tuple(out))
    if layer != shape.num_layers:
        raise EstimateError(f"the pipeline layout holds {layer} decoder layers, num_layers is {shape.num_layers}")
    chunks = tuple(tuple(numbered[v * pp + r] for v in range(vpp)) for r in range(pp))
    return Parallel(world=world, tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, etp=etp,
                    sequence_parallel=bool(args.sequence_parallel), chunks=chunks)


def tokens_per_microbatch(shape: ModelShape, par: Parallel) -> int:
    """Tokens one GPU holds activations for in one micro-batch: sequence parallelism splits the
    layer-norm / residual tensors over TP; context parallelism splits the sequence."""
    return shape.micro_batch * shape.seq_length // par.cp


def microbatches_per_step(shape: ModelShape, par: Parallel) -> int:
    return max(1, shape.global_batch // (shape.micro_batch * par.dp))
