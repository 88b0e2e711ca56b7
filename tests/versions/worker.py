"""One rank of the version-matrix scenarios of one release, run as its own process (never imported
by pytest):

    python tests/versions/worker.py RANK WORLD INIT_FILE MEGATRON_DIR EXPECTED_VERSION SCENARIOS_JSON

MEGATRON_DIR (a `pip install --target` folder of one megatron-core release) goes first on sys.path,
then torch.cuda is emulated on the CPU (tests/support/cuda_on_cpu.py) before Megatron is imported. The checks
are the distributed MoE-layer scenarios' (tests/support/moe_layer_checks.py, whose helpers are reused
here) at sizes the Triton interpreter gets through in seconds. SCENARIOS_JSON maps scenario names to
their check and its arguments; they run one after the other in this process (start-up and imports
once), each from the same seed, and each prints one `RESULT {json}` line: "ok" and the check's own
result, or "failed" with the assertion's message. Any other exception ends the process (exit 1)."""

import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


def build_layer(config, **options):
    """The one place that builds a layer: Megatron's local spec (SequentialMLP experts) through the
    plugin's public API; `options` are FP4Options' fields (none: stock Megatron)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    from megatron_fp4.integration import FP4Options, use_fp4

    spec = use_fp4(get_gpt_layer_local_spec(num_experts=config.num_moe_experts), FP4Options(**options))
    # Releases differ in whether the MoE builder is a ModuleSpec or a partial.
    mlp = spec.submodules.mlp
    layer = build_module(mlp, config=config) if isinstance(mlp, ModuleSpec) else mlp(config=config)
    layer.set_layer_number(1)
    return layer


def _finite(where, *tensors):
    for t in tensors:
        values = t.values() if isinstance(t, dict) else [t]
        assert all(v is not None and torch.isfinite(v.float()).all() for v in values), f"{where}: not finite"


def _with_reference_dispatcher(layer, config, scale_rule, grad_format, overlap=False):
    """`layer` (stock experts) behind Megatron's own dispatcher fed reference-rounded tokens."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    old = layer.token_dispatcher
    layer.token_dispatcher = checks._reference_dispatcher_class(scale_rule, grad_format)(
        old.num_local_experts, old.local_expert_indices, config=config, pg_collection=get_default_pg_collection())
    if overlap:
        layer.token_dispatcher.set_shared_experts(layer.shared_experts)
    return layer


def check_dispatch(rank, dispatch_grad="bf16", scale_rule="ceil", overlap=False, saved_input=False):
    """FP4 layer == stock layer fed reference-rounded tokens, bit for bit (forward, input and
    parameter gradients); != the unrounded stock layer; with saved_input the same bits again."""
    from megatron_fp4.dispatch.token_dispatcher import FP4AlltoAllTokenDispatcher

    config = checks._config(1, 2, overlap)
    fp4 = {"dispatch": True, "scale_rule": scale_rule, "dispatch_grad": dispatch_grad}
    stock, ours = build_layer(config), build_layer(config, **fp4)
    rounded = _with_reference_dispatcher(build_layer(config), config, scale_rule, dispatch_grad, overlap)
    assert isinstance(ours.token_dispatcher, FP4AlltoAllTokenDispatcher)
    assert (ours.token_dispatcher.shared_experts is not None) == overlap, "shared-expert overlap not wired"
    layers = {"fp4": ours, "rounded": rounded, "stock": stock}
    if saved_input:
        layers["saved"] = build_layer(config, **fp4, saved_input=True)
    for layer in layers.values():
        layer.load_state_dict(stock.state_dict())
    x, gy = checks._inputs(rank, 1)
    runs = {name: checks._run(layer, x, gy) for name, layer in layers.items()}
    where = f"rank {rank} {fp4} overlap={overlap}"
    for name, (out, dx, grads) in runs.items():
        _finite(f"{where} {name}", out, dx, grads)
    out, dx, grads = runs["fp4"]
    assert not checks._same_bits(out, runs["stock"][0]), f"{where}: FP4 dispatch did not round anything"
    for name in ["rounded"] + (["saved"] if saved_input else []):
        out_r, dx_r, grads_r = runs[name]
        assert checks._same_bits(out, out_r), f"{where}: forward output differs from {name}"
        assert checks._same_bits(dx, dx_r), f"{where}: input gradient differs from {name}"
        for key, g in grads_r.items():
            assert checks._same_bits(grads[key], g), f"{where}: gradient of {key} differs from {name}"
    return {"parameters": len(grads)}


def check_cache(rank, experts="bf16"):
    """recompute_modules ["moe"], micro-batches in flight: with --moe-fp4-cache the recompute sends
    no forward dispatch (uint8 all-to-alls counted in the backward) and outputs and gradients
    equal the uncached layer's bit for bit; without it each recompute sends one."""
    config = checks._config(1, 2, False, recompute_granularity="selective", recompute_modules=["moe"])
    uncached = build_layer(config, dispatch=True, experts=experts)
    cached = build_layer(config, dispatch=True, cache=True, experts=experts)
    cached.load_state_dict(uncached.state_dict())
    assert cached.moe_layer_recompute, "recompute_modules ['moe'] did not checkpoint the layer"
    pairs = [checks._inputs(10 * rank + m, 1) for m in range(checks.MICRO_BATCHES)]
    inputs, grads = [p[0] for p in pairs], [p[1] for p in pairs]
    with checks._counting_all_to_all_sends() as sends:
        out_u, dx_u, dw_u, sends_u = checks._checkpointed_steps(uncached, inputs, grads, sends)
        out_c, dx_c, dw_c, sends_c = checks._checkpointed_steps(cached, inputs, grads, sends)
    where = f"rank {rank} cache, {experts} experts"
    _finite(where, *out_c, *dx_c, dw_c)
    assert sends_u == checks.MICRO_BATCHES, f"{where}: the uncached recompute sent {sends_u} dispatches"
    assert sends_c == 0, f"{where}: the cached recompute still sent {sends_c} dispatches"
    assert len(cached.recompute_cache) == 0, f"{where}: entries left after backward"
    for a, b in zip(out_c + dx_c, out_u + dx_u):
        assert checks._same_bits(a, b), f"{where}: outputs or input gradients differ"
    for key, g in dw_u.items():
        assert checks._same_bits(dw_c[key], g), f"{where}: gradient of {key} differs"
    return {"uncached_recompute_dispatches": sends_u}


def check_fp8_experts(rank):
    """FP4 dispatch + FP8 experts: output equal to the same FP8 experts behind Megatron's dispatcher
    fed reference-rounded tokens; gradients within the MXFP4-saved-activation error of it."""
    from megatron_fp4.experts import FP8Experts

    config = checks._config(1, 2, False)
    ours = build_layer(config, dispatch=True, experts="fp8")
    rounded = _with_reference_dispatcher(build_layer(config, experts="fp8"), config, "ceil", "bf16")
    assert isinstance(ours.experts, FP8Experts)
    rounded.load_state_dict(ours.state_dict())
    x, gy = checks._inputs(rank, 1)
    (out, dx, grads), (out_r, dx_r, grads_r) = checks._run(ours, x, gy), checks._run(rounded, x, gy)
    where = f"rank {rank} FP8 experts"
    _finite(where, out, dx, grads)
    assert checks._same_bits(out, out_r), f"{where}: output differs from the same experts on rounded tokens"
    errors = {key: checks._relative(grads[key], g) for key, g in grads_r.items()}
    errors["input"] = checks._relative(dx, dx_r)
    assert max(errors.values()) < 0.25, f"{where}: gradients far from the rounded baseline: {errors}"
    return {"largest_gradient_difference": max(errors.values())}


CHECKS = {"dispatch": check_dispatch, "cache": check_cache, "fp8_experts": check_fp8_experts}


def main(rank, world, init_file, megatron_dir, expected_version, scenarios):
    sys.path[:0] = [megatron_dir, ROOT, TESTS]  # this checkout's megatron_fp4, whatever is installed
    from support import cuda_on_cpu  # noqa: F401  (before Megatron, which reads torch.cuda at import)

    cuda_on_cpu.install()
    global checks, torch
    import torch
    import torch.distributed as dist
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from support import moe_layer_checks as checks

    # What runs must be the version folder's megatron-core and this checkout's megatron_fp4, not the venv's.
    found = (megatron.core.__version__, os.path.dirname(megatron.core.__file__))
    assert found[0].split("+")[0] == expected_version, f"megatron-core {found}, expected {expected_version}"
    assert found[1].startswith(megatron_dir), f"megatron-core from {found[1]}, not {megatron_dir}"
    import megatron_fp4

    assert megatron_fp4.__file__.startswith(ROOT), f"megatron_fp4 from {megatron_fp4.__file__}, not {ROOT}"
    vars(checks).update(checks.EMULATED_SIZES)  # the interpreter is slow
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world, expert_tensor_parallel_size=1)
    for name, scenario in scenarios.items():
        model_parallel_cuda_manual_seed(1234)
        kwargs = dict(scenario)
        try:
            result = dict(CHECKS[kwargs.pop("check")](rank, **kwargs), status="ok")
        except AssertionError as error:  # the ranks stay in step: the next scenario starts on both
            result = {"status": "failed", "error": str(error)}
        print("RESULT " + json.dumps(dict(result, scenario=name, rank=rank, megatron_core=found[0])), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], json.loads(sys.argv[6]))
