"""The FP8 weight cache (megatron_fp4/fp8/weight_cache.py) on its own: reused while the weights
stay the same, re-quantized after any optimizer step, an in-place write or new storage. By default it holds W
only: the layers make W^T in each backward (tests/integration/test_fp8_linears.py, test_fp8_experts.py); with
keep_transposed (--moe-fp4-keep-transposed-weights) W^T too, under the same rules."""

import torch

from megatron_fp4 import kernels as K
from megatron_fp4.fp8.weight_cache import FP8WeightCache, fp8_weights, optimizer_steps


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
    assert transposed.data.shape[1:] == (256, 128) and list(cache._entries) == [("fc1", False)]  # W^T is not kept
    assert fp8_weights(cache, "fc1", weights, transpose=False) is held
    # Without a cache every copy is made for its GEMM, through the caller's quantizer when given.
    made = []
    def quantize(ws, transpose):
        made.append(transpose)
        return K.quantize_fp8_weights_stacked(ws, transpose)

    assert _same(fp8_weights(None, "fc1", weights, False, quantize), held) and made == [False]


def test_a_cache_keeping_transposes_reuses_w_transposed_until_the_weights_change(device):
    """keep_transposed: W^T made once from the cached W (its blocks transposed: the bits of quantizing
    W^T), the same object for every later GEMM of the step, held beside W, and made again, from the
    new W, after an optimizer step or an in-place write; a caller's quantizer (the FP8 linears'
    padded one) makes it the same way."""
    cache, weights = FP8WeightCache(keep_transposed=True), _weights(device)
    transposed = fp8_weights(cache, "fc1", weights, transpose=True)
    assert _same(transposed, K.quantize_fp8_weights_stacked(weights, True))
    assert fp8_weights(cache, "fc1", weights, transpose=True) is transposed
    held = fp8_weights(cache, "fc1", weights, transpose=False)
    assert sorted(cache._entries) == [("fc1", False), ("fc1", True)]
    # W [2, 128, 256] with scales [2, 1, 4]; W^T [2, 256, 128] with scales [2, 2, 4] (padded to 4 columns).
    assert cache.held_bytes() == 2 * (2 * 128 * 256) + 2 * 1 * 4 * 4 + 2 * 2 * 4 * 4

    with torch.no_grad():
        weights[1].mul_(-3)
    after_write = fp8_weights(cache, "fc1", weights, transpose=True)
    assert after_write is not transposed and _same(after_write, K.quantize_fp8_weights_stacked(weights, True))
    assert fp8_weights(cache, "fc1", weights, transpose=False) is not held  # W was made again for it
    other = torch.nn.Parameter(torch.zeros(1, device=device))
    other.grad = torch.ones(1, device=device)
    torch.optim.SGD([other], lr=0.1).step()
    assert fp8_weights(cache, "fc1", weights, transpose=True) is not after_write

    made = []
    def quantize(ws, transpose):
        made.append(transpose)
        return K.quantize_fp8_weights_stacked(ws, transpose)

    for _ in range(2):
        by_caller = fp8_weights(cache, "fc2", weights, True, quantize)
    assert made == [True] and _same(by_caller, K.quantize_fp8_weights_stacked(weights, True))


_HOOK_SCRIPT = """
import torch
import torch.nn.functional as F
from torch.optim import optimizer as torch_optimizer
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import megatron_fp4
from megatron_fp4 import experts, fp8, integration, linears  # noqa: F401
from megatron_fp4.fp8 import weight_cache
from megatron_fp4.integration.experts_spec import use_fp8_experts
from megatron_fp4.options import FP4Options
from support.one_rank import one_rank_parallel_state

hooks = torch_optimizer._global_optimizer_post_hooks
assert not hooks, f"importing the package registered optimizer hooks: {dict(hooks)}"
config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_moe_experts=2,
                           moe_router_topk=2, moe_ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                           add_bias_linear=False,
                           use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                           gradient_accumulation_fusion=False)
with one_rank_parallel_state() as pg_collection:
    for per_use, expected in ((True, 0), (False, 1), (False, 1)):
        spec = use_fp8_experts(get_gpt_layer_local_spec(num_experts=2), FP4Options(experts="fp8",
                                                                                  weights_per_use=per_use))
        spec.submodules.mlp.keywords["submodules"].experts(2, config, pg_collection=pg_collection)
        assert len(hooks) == expected, (per_use, len(hooks))
steps = weight_cache.optimizer_steps()
param = torch.nn.Parameter(torch.zeros(1))
param.grad = torch.ones(1)
torch.optim.SGD([param], lr=0.1).step()
assert weight_cache.optimizer_steps() == steps + 1
print("ok")
"""


def test_the_step_hook_is_installed_by_building_cached_fp8_modules_not_by_importing():
    """Importing megatron_fp4 registers no optimizer hook; building FP8 experts through the layer spec
    with a weight cache installs the step counter once (a second build adds none), without a cache
    (--moe-fp4-weights-per-use) none. In a process of its own: this one's caches installed it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", _HOOK_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr[-3000:]


def test_count_optimizer_steps_installs_the_hook_once():
    from torch.optim import optimizer as torch_optimizer

    from megatron_fp4.fp8.weight_cache import count_optimizer_steps

    FP8WeightCache()
    before = len(torch_optimizer._global_optimizer_post_hooks)
    count_optimizer_steps()
    FP8WeightCache()
    assert len(torch_optimizer._global_optimizer_post_hooks) == before
