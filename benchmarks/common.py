"""What the MoE-layer benchmarks and profiles share: their options, the expert-parallel setup on
torchrun, the layer config, and CUDA-event timing taken as the slowest rank's median; and the
kernel benchmarks' ragged expert counts."""

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.rows import Recorder


def ragged_counts(tokens: int, experts: int, seed: int) -> torch.Tensor:
    """Random expert sizes summing to tokens, a quarter of the experts empty (the kernel benchmarks'
    ragged case)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=g)
    weights[torch.randperm(experts, generator=g)[: experts // 4]] = 0
    counts = torch.floor(weights / weights.sum() * tokens).long()
    counts[int(torch.argmax(weights))] += tokens - int(counts.sum())
    return counts


def layer_options(description: str) -> argparse.ArgumentParser:
    """The MoE layer's shape and the timing options (DeepSeek-V3 layer dimensions by default)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048, help="expert FFN hidden size")
    p.add_argument("--experts", type=int, default=32, help="routed experts (divisible by the GPU count)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--grad", choices=("bf16", "fp8"), default="bf16", help="FP4 dispatch gradient format")
    return p


def layer_shape(args) -> dict:
    """The fields every result row of a layer benchmark carries."""
    return {"hidden": args.hidden, "ffn": args.ffn, "experts": args.experts, "topk": args.topk,
            "tokens_per_gpu": args.tokens, "grad": args.grad, "iters": args.iters}


def slowest_median_ms(fn, iters: int, warmup: int) -> float:
    """Median of per-iteration CUDA-event times on this rank, then the max over ranks."""
    return interleaved_medians_ms({"fn": fn}, iters, warmup)["fn"]


def interleaved_times_ms(fns: dict, iters: int, warmup: int) -> dict:
    """This rank's per-round times of several functions measured in turns (one call of each per
    round, the order rotating), so that clock and thermal drift over the run hit all of them alike:
    for differences between rows smaller than the run-to-run spread."""
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(warmup + iters):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(start.elapsed_time(end))
    return times


def interleaved_medians_ms(fns: dict, iters: int, warmup: int) -> dict:
    """Per function: the median of its per-round times on this rank (timed in turns,
    interleaved_times_ms), then the max over ranks."""
    times = interleaved_times_ms(fns, iters, warmup)
    medians = torch.tensor([statistics.median(t) for t in times.values()], device="cuda")
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(times, medians.tolist()))


def paired_differences_ms(first, second, op=dist.ReduceOp.MIN):
    """(median, first quartile, third quartile) of the per-round differences first - second of two
    functions timed in turns (interleaved_times_ms), each reduced over ranks with `op` (MIN: the
    smallest saving any rank sees; MAX: the largest cost)."""
    differences = [a - b for a, b in zip(first, second)]
    q1, _, q3 = statistics.quantiles(differences, n=4)
    stats = torch.tensor([statistics.median(differences), q1, q3], device="cuda")
    dist.all_reduce(stats, op=op)
    return tuple(stats.tolist())


def max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def moe_config(args, world: int, **extra):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **extra,
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.hidden // 128, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=1e-3, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, expert_model_parallel_size=world, expert_tensor_parallel_size=1,
    )


def permuted_tokens_and_splits(layer, x):
    """The dispatcher's own routing and permutation of x: (permuted tokens, output splits, input splits)."""
    dispatcher = layer.token_dispatcher
    with torch.no_grad():
        probs, routing_map = layer.router(x)
        tokens, _probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
        dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall", dispatcher.tokens_per_expert)
    torch.cuda.synchronize()
    return tokens, [int(n) for n in dispatcher.output_splits], [int(n) for n in dispatcher.input_splits]


def start_expert_parallel(args, bench: str, what: str):
    """NCCL on this torchrun rank's GPU (launched without torchrun: one rank, EP 1; gloo where CUDA
    is absent, i.e. the CPU tests' emulation), Megatron's parallel state with EP = all GPUs, the
    seed; returns (rank, world size, a print that only rank 0 shows, the run's Recorder), after
    printing the run's header."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    backend = {"backend": "nccl", "device_id": torch.device("cuda", local_rank)} if torch.cuda.is_available() \
        else {"backend": "gloo"}
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(**backend)
    else:
        dist.init_process_group(**backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        raise SystemExit(f"--experts {args.experts} must be divisible by the number of GPUs ({world})")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    log = print if rank == 0 else (lambda *a, **k: None)
    recorder = Recorder(bench, gpus=world, **layer_shape(args))
    log(recorder.description())
    log(f"EP {world}, {args.experts} experts, top-{args.topk}, hidden {args.hidden}, expert FFN {args.ffn}, "
        f"{args.tokens} tokens per GPU, {what}")
    return rank, world, log, recorder


def finish(rank: int, recorder: Recorder) -> None:
    """Rank 0 appends the run's rows; every rank leaves the process group."""
    from megatron.core import parallel_state

    if rank == 0:
        recorder.write()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def layer_step(layer, x, grad):
    """One forward + backward of the layer on a fresh leaf copy of x, the parameters' gradients set
    to None first: Megatron's DDP moves each gradient into main_grad and sets it to None, so a
    training backward never adds into an earlier .grad (without this every step would pay a BF16
    add over all expert weights, 2 ms at 32 DeepSeek-V3 experts). The parameters are listed once:
    module.zero_grad walks the module tree every call, host time (~1 ms under cProfile at 32
    experts, more for a layer of more modules) that the timed step would count and a training
    step does not spend."""
    params = list(layer.parameters())

    def step():
        for param in params:
            param.grad = None
        out, _ = layer(x.detach().requires_grad_(True))
        out.backward(grad)
    return step


def peak_memory_gib(fn) -> float:
    """Peak allocated memory while fn runs, max over ranks."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return max_over_ranks(torch.cuda.max_memory_allocated() / 2**30)


def random_tokens(args, rank: int):
    """This rank's layer input [tokens, 1, hidden] and output gradient, BF16, seeded by the rank."""
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", generator=g).bfloat16()
    grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16()
    return x, grad


def with_lean_permute(layer, config):
    """The layer with Megatron's all-to-all dispatcher replaced by one with megatron_fp4's permute."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_fp4.dispatch.permute import LeanPermute

    class LeanPermuteDispatcher(LeanPermute, MoEAlltoAllTokenDispatcher):
        pass

    if layer.shared_experts is not None:
        raise ValueError("the benchmark's layers have no shared expert; this dispatcher would need set_shared_experts")
    layer.token_dispatcher = LeanPermuteDispatcher(layer.num_local_experts, layer.local_expert_indices, config=config,
                                                   pg_collection=get_default_pg_collection())
    return layer
