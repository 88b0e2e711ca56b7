"""The FP8 weight caches (experts and linears) inside Megatron's training step
(tests/distributed/test_weight_cache_in_training.py), run by both ranks: the tiny GPTModel of
checkpoint_scenarios with the whole FP4 recipe, in
Megatron's DDP with its distributed Adam, two micro-batches per step, with and without
--overlap-param-gather (the new weights then arrive by all-gather in the next forward's pre-hooks).
The caches keep W^T too (--moe-fp4-keep-transposed-weights), so that both copies are checked: W
alone is the same code under the same stamp."""

import torch

from support.checkpoint_scenarios import BATCH, SEQ, VOCAB, Run, log

STEPS, MICRO_BATCHES = 2, 2  # the second step's forwards must re-quantize what the first step's update changed


def _cached_modules(run: Run) -> list:
    """(name, FP8WeightCache, {cache entry name: weights}, the quantizer the cache calls) of every
    FP8 module of the model: the routed experts and the FP8 linear layers."""
    from megatron_fp4 import kernels as K
    from megatron_fp4.experts import FP8Experts
    from megatron_fp4.linears import FP8ColumnParallelLinear, FP8RowParallelLinear
    from megatron_fp4.linears.function import quantize_weight_padded

    found = []
    for name, module in run.gpt.named_modules():
        if isinstance(module, FP8Experts):
            weights = {"fc1": [e.linear_fc1.weight for e in module.local_experts],
                       "fc2": [e.linear_fc2.weight for e in module.local_experts]}
            found.append((name, module.weight_cache, weights, K.quantize_fp8_weights_stacked))
        elif isinstance(module, (FP8ColumnParallelLinear, FP8RowParallelLinear)):
            found.append((name, module.fp8.weight_cache, {"weight": [module.weight]}, quantize_weight_padded))
    return found


def _copies_per_step(modules) -> int:
    """W of each linear layer's weights, and W^T (kept for the step): one per FP8 linear, two per experts
    module (fc1, fc2)."""
    return sum(len(weights) for _, _, weights, _ in modules)


def _linears(modules) -> int:
    """FP8 linear layers (the experts' W^T is transposed from their W, not quantized)."""
    return sum("weight" in weights for _, _, weights, _ in modules)


def _stale_entries(modules) -> list:
    """(module, weights) of every cached FP8 copy that differs from quantizing the weights now."""
    stale = []
    for module_name, cache, weights, quantize in modules:
        for (name, transposed), (_, cached) in cache._entries.items():
            fresh = quantize(weights[name], transposed)
            if not (torch.equal(cached.data.view(torch.uint8), fresh.data.view(torch.uint8))
                    and torch.equal(cached.block_scales, fresh.block_scales)):
                stale.append((module_name, name))
    return stale


def _forward_backward(run: Run, step: int) -> None:
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    for micro_batch in range(MICRO_BATCHES):
        g = torch.Generator().manual_seed(100 * step + 10 * micro_batch + torch.distributed.get_rank())
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        run.model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()


def _optimizer_step(run: Run) -> None:
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([run.model])
    updated, _, _ = run.optimizer.step()
    assert updated


def tracks_the_optimizer(overlap_param_gather: bool, directory: str) -> None:
    """Weights quantized once per step (W and W^T of every FP8 linear and of the experts' fc1 and fc2,
    for two micro-batches' forwards and backwards), never a stale copy; and the staleness check flags the
    copies once the optimizer has changed the weights under them, so it can fail."""
    from megatron_fp4 import kernels as K

    run = Run(plugin=True, seed=1, overlap_param_gather=overlap_param_gather)
    modules = _cached_modules(run)
    for _, cache, _, _ in modules:
        cache.keep_transposed = True
    quantized = []
    real_quantize = K.quantize_fp8_weights_stacked
    def counting_quantize(weights, transpose=False, *args, **kwargs):
        quantized.append(transpose)  # W and the linears' W^T once a step
        return real_quantize(weights, transpose, *args, **kwargs)

    K.quantize_fp8_weights_stacked = counting_quantize
    try:
        for step in range(STEPS):
            quantized.clear()
            _forward_backward(run, step)
            plain, transposed = quantized.count(False), quantized.count(True)
            assert plain == _copies_per_step(modules), f"step {step}: W quantized {plain} times"
            assert transposed == _linears(modules), f"step {step}: the linears' W^T quantized {transposed} times"
            kept = sum(key[1] for _, cache, _, _ in modules for key in cache._entries)
            assert kept == _copies_per_step(modules), f"step {step}: {kept} W^T kept"
            assert not _stale_entries(modules), f"step {step}: stale FP8 weights {_stale_entries(modules)}"
            _optimizer_step(run)
    finally:
        K.quantize_fp8_weights_stacked = real_quantize
    # The optimizer has changed this rank's shards in place; gather the rest now (with
    # --overlap-param-gather the next forward's pre-hooks would), so that every weight is the new one
    # while the copies are still those of the last forward. The dense FP8 linears always get a
    # gradient, so each of their copies must be flagged.
    run.model.start_param_sync(force_sync=True)
    flagged = {module_name for module_name, _ in _stale_entries(modules)}
    linears = {module_name for module_name, _, weights, _ in modules if "weight" in weights}  # _cached_modules' key
    assert linears and linears <= flagged, f"the staleness check missed changed weights of {sorted(linears - flagged)}"
    log(f"overlap_param_gather={overlap_param_gather}: quantized once per step, never stale")


def run(rank: int, scratch: str, overlap_param_gather: bool) -> None:
    """Both settings' scenario on this rank (two gloo ranks, torch.cuda emulated), EP 2."""
    from megatron.core import parallel_state

    from support import megatron_training_on_cpu

    megatron_training_on_cpu.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    try:
        tracks_the_optimizer(overlap_param_gather, scratch)
    finally:
        parallel_state.destroy_model_parallel()
