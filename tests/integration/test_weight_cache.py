"""The FP8 weight cache (megatron_fp4/experts/weight_cache.py) on its own: reused while the weights
stay the same, re-quantized after any optimizer step, an in-place write or new storage. It holds W only: the
layers quantize W^T in each backward (tests/integration/test_fp8_linears.py, test_fp8_experts.py)."""

import torch

from megatron_fp4 import kernels as K
from megatron_fp4.experts.weight_cache import FP8WeightCache, fp8_weights, optimizer_steps


def _weights(device, n=2):
    torch.manual_seed(0)
    return [torch.nn.Parameter((torch.randn(128, 256) * 0.02).bfloat16().to(device)) for _ in range(n)]


def _same(a, b) -> bool:
    return torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.block_scales, b.block_scales)


def test_reused_until_the_weights_change(device):
    cache, weights = FP8WeightCache(), _weights(device)
    first = cache.get("fc1", weights)
    assert cache.get("fc1", weights) is first  # the same step: no new quantization
    # Only W is held: data, and fp32 scales padded to 4 columns ([2, 1, 4]).
    assert cache.held_bytes() == 2 * 128 * 256 + 2 * 1 * 4 * 4

    with torch.no_grad():
        weights[0].mul_(2)  # an in-place write through autograd (load_state_dict's copy_ is one)
    changed = cache.get("fc1", weights)
    assert changed is not first and _same(changed, K.quantize_fp8_weights_stacked(weights))


def test_an_optimizer_step_invalidates_even_writes_autograd_cannot_see(device):
    """Megatron's optimizers may write the new weights through .data (no version bump): the step
    itself, seen through torch's global optimizer hook, invalidates the copies."""
    cache, weights = FP8WeightCache(), _weights(device)
    stale = cache.get("fc2", weights)
    weights[1].data.copy_(weights[1].data * 4)  # invisible to the version counter
    assert cache.get("fc2", weights) is stale  # documented: call invalidate() after such writes
    other = torch.nn.Parameter(torch.zeros(1, device=device))
    other.grad = torch.ones(1, device=device)
    steps = optimizer_steps()
    torch.optim.SGD([other], lr=0.1).step()  # any optimizer's step
    assert optimizer_steps() == steps + 1
    fresh = cache.get("fc2", weights)
    assert fresh is not stale and _same(fresh, K.quantize_fp8_weights_stacked(weights))
    cache.invalidate()
    assert cache.held_bytes() == 0


def test_a_gemm_reads_w_from_the_cache_and_w_transposed_quantized_for_it(device):
    cache, weights = FP8WeightCache(), _weights(device)
    held = fp8_weights(cache, "fc1", weights, transpose=False)
    assert fp8_weights(cache, "fc1", weights, transpose=False) is held
    transposed = fp8_weights(cache, "fc1", weights, transpose=True)
    assert _same(transposed, K.quantize_fp8_weights_stacked(weights, True))
    assert transposed.data.shape[1:] == (256, 128) and list(cache._entries) == ["fc1"]  # W^T is not kept
    assert fp8_weights(cache, "fc1", weights, transpose=False) is held
    # Without a cache every copy is made for its GEMM, through the caller's quantizer when given.
    made = []
    def quantize(ws, transpose):
        made.append(transpose)
        return K.quantize_fp8_weights_stacked(ws, transpose)

    assert _same(fp8_weights(None, "fc1", weights, False, quantize), held) and made == [False]
