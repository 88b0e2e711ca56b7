"""YAML run configs: includes and overrides, unknown keys with close matches, YAML -> command line ->
Megatron's parser round trip, every shipped config loads, and a config is refused as a launch
would refuse it."""

import argparse
import sys
from pathlib import Path

import pytest

from megatron_fp4.cli import main as cli_main
from megatron_fp4.options import FP4Options, UnsupportedConfiguration
from megatron_fp4.run_config import (
    ConfigError,
    known_flags,
    load_config,
    parse_config_argv,
    planned_args,
    validate_config,
)
from support.entry_points import one_error_line

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(CONFIGS.glob("**/*.yaml"))
ROUND_TRIP = [p for p in SHIPPED if "scopes" not in p.parts]  # scope files are fragments


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def _expected(action: argparse.Action, value):
    """What Megatron's parser should hold for `value` written by the config."""
    if action.nargs == 0:
        return action.const
    convert = action.type or (lambda v: v)
    if isinstance(value, list) or action.nargs in ("+", "*"):
        return [convert(str(v)) for v in (value if isinstance(value, list) else [value])]
    return convert(str(value))


def test_include_override_and_switch_off(tmp_path):
    _write(tmp_path, "base.yaml", "num_layers: 4\nhidden_size: 1024\nmoe_fp4_dispatch: true\n"
                                  "cluster: {nodes: 2, gpus_per_node: 8, gpu_memory_gib: 80}\n")
    child = _write(tmp_path, "child.yaml", "include: base.yaml\nnum_layers: 6\nmoe_fp4_dispatch: false\n"
                                           "recompute_modules: [moe, layernorm]\ncluster: {nodes: 4}\n")
    config = load_config(child)
    assert config.argv() == ["--hidden-size", "1024", "--num-layers", "6", "--recompute-modules", "moe", "layernorm"]
    assert config.cluster == {"nodes": 4, "gpus_per_node": 8, "gpu_memory_gib": 80.0}
    assert config.world_size() == 32
    args = parse_config_argv(config)
    assert (args.num_layers, args.hidden_size, args.moe_fp4_dispatch) == (6, 1024, False)
    assert args.recompute_modules == ["moe", "layernorm"]


def test_unknown_key_names_close_matches(tmp_path):
    path = _write(tmp_path, "bad.yaml", "num_layer: 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'num_layer'.*did you mean num_layers"):
        load_config(path)
    path = _write(tmp_path, "bad_fp4.yaml", "moe_fp4_dispach: true\n")
    with pytest.raises(ConfigError, match="did you mean moe_fp4_dispatch"):
        load_config(path)
    with pytest.raises(ConfigError, match="unknown cluster key 'gpus'"):
        load_config(_write(tmp_path, "bad_cluster.yaml", "cluster: {gpus: 8}\n"))


def test_bad_values_and_files(tmp_path):
    with pytest.raises(ConfigError, match="is a switch"):
        load_config(_write(tmp_path, "switch.yaml", "bf16: 1\n"))
    with pytest.raises(ConfigError, match="include cycle"):
        _write(tmp_path, "a.yaml", "include: b.yaml\n")
        load_config(_write(tmp_path, "b.yaml", "include: a.yaml\n"))
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(_write(tmp_path, "list.yaml", "- num_layers\n"))


@pytest.mark.parametrize("path", ROUND_TRIP, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_shipped_config_round_trips_through_megatrons_parser(path):
    config = load_config(path)
    args = parse_config_argv(config)
    flags = known_flags()
    for name, value in config.flags.items():
        if value is None or value is False:
            continue
        option, action = flags[name]
        assert getattr(args, action.dest) == _expected(action, value), f"{path.name}: {name}"
    validate_config(config)  # a launch of it would not be refused


def test_671b_configs_are_the_recipe():
    variants = {p.stem: load_config(p) for p in (CONFIGS / "deepseek_v3_671b").glob("*_*.yaml")}
    assert len(variants) == 9
    for name, config in variants.items():
        args = parse_config_argv(config)
        assert config.world_size() == 256 and config.cluster["gpu_memory_gib"] == 80
        assert (args.num_layers, args.hidden_size, args.num_experts, args.moe_router_topk) == (61, 7168, 256, 8)
        assert args.moe_layer_freq[:3] == [0, 0, 0] and sum(args.moe_layer_freq) == 58
        assert (args.pipeline_model_parallel_size, args.expert_model_parallel_size) == (8, 32)
        precision = name.split("_")[0]
        assert args.moe_fp4_dispatch is (precision == "fp4")
        # FP8 and FP4: our FP8 linears and experts on Megatron's local layers (no Transformer Engine
        # FP8); FP4 adds MXFP4 storage everywhere (the paper's recipe).
        ours = precision in ("fp8", "fp4")
        assert args.fp8 is None
        assert (args.moe_fp4_linears == "fp8", args.moe_fp4_experts == "fp8", args.transformer_impl == "local") == (
            ours, ours, ours)
        assert (args.moe_fp4_storage == "all") is (precision == "fp4")
        assert args.moe_fp4_cache is (name == "fp4_attn_ln_moe")


PROXY_PRECISIONS = {"bf16": FP4Options(), "fp4": FP4Options(dispatch=True),
                    "fp4_fp8": FP4Options(dispatch=True, experts="fp8")}


def test_proxy_configs_name_their_precision():
    # configs/proxy/gpus<N>_<precision>.yaml: the file alone says what runs (scripts/train_proxy.sh picks one).
    variants = sorted((CONFIGS / "proxy").glob("gpus*_*.yaml"))
    assert [p.stem for p in variants] == [f"gpus{n}_{precision}" for n in (1, 2, 4, 8) for precision in
                                          sorted(PROXY_PRECISIONS)]
    for path in variants:
        config = load_config(path)
        gpus, precision = path.stem[len("gpus"):].split("_", 1)
        assert config.world_size() == int(gpus) == config.flags["expert_model_parallel_size"]
        assert "moe_fp4_dispatch" in config.flags and "moe_fp4_experts" in config.flags  # said, not defaulted
        assert validate_config(config) == PROXY_PRECISIONS[precision], path.name


def test_cli_prints_the_command_line(tmp_path, capsys):
    path = _write(tmp_path, "c.yaml", "num_layers: 2\nnum_experts: 4\nmoe_token_dispatcher_type: alltoall\n"
                                      "moe_fp4_dispatch: true\n")
    assert cli_main(["argv", str(path)]) == 0
    assert capsys.readouterr().out.strip() == ("--num-layers 2 --num-experts 4 --moe-token-dispatcher-type alltoall "
                                               "--moe-fp4-dispatch")
    assert cli_main(["argv", str(_write(tmp_path, "bad.yaml", "num_layer: 2\n"))]) == 2


def test_validate_config_refuses_what_a_launch_refuses(tmp_path, capsys):
    path = _write(tmp_path, "allgather.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2.yaml'}\nmoe_fp4_dispatch: true\n"
                                              "moe_token_dispatcher_type: allgather\n")
    with pytest.raises(UnsupportedConfiguration,
                       match=r"needs --moe-token-dispatcher-type alltoall or flex \(got allgather\)"):
        validate_config(load_config(path))
    assert cli_main(["argv", str(path)]) == 2
    assert capsys.readouterr().err.startswith(
        "error: --moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall or flex")
    # Extra flags count; no CUDA is needed (the plan is for another machine).
    proxy = load_config(CONFIGS / "proxy" / "gpus2.yaml")
    assert validate_config(proxy, ["--moe-fp4-dispatch"]) == FP4Options(dispatch=True)
    with pytest.raises(UnsupportedConfiguration, match="--moe-fp4-cache needs --moe-fp4-dispatch"):
        validate_config(proxy, ["--moe-fp4-cache"])


def test_planned_args_derive_megatrons_defaults(tmp_path):
    # Megatron's validate_args derives these; a refusal must see them (here: ETP = TP = 2).
    path = _write(tmp_path, "etp.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2.yaml'}\nmoe_fp4_dispatch: true\n"
                                        "tensor_model_parallel_size: 2\nexpert_tensor_parallel_size: null\n"
                                        "moe_ffn_hidden_size: null\nffn_hidden_size: null\n")
    args = planned_args(load_config(path))
    assert args.expert_tensor_parallel_size == 2
    assert args.moe_ffn_hidden_size == args.ffn_hidden_size == int(4 * 1024 * 2 / 3 / 64) * 64  # SwiGLU
    with pytest.raises(UnsupportedConfiguration, match="use --expert-tensor-parallel-size 1 .got 2."):
        validate_config(load_config(path))


@pytest.mark.parametrize("text, message", [
    ("micro_batch_size: four\n", "micro_batch_size: invalid int value: 'four'"),
    ("moe_fp4_experts: fp4\n", "moe_fp4_experts: invalid choice: 'fp4' (choose from 'bf16', 'fp8')"),
    ("micro_batch_size: true\n", "micro_batch_size takes a value (--micro-batch-size MICRO_BATCH_SIZE), not true"),
    ("micro_batch_size: [1, 2]\n", "micro_batch_size takes one value, not a list ([1, 2])"),
    ("moe_fp4_bf16_linears: [attention, attn]\n", "moe_fp4_bf16_linears: invalid choice: 'attn'"),
    ("cluster: {nodes: two}\n", "cluster.nodes must be a positive whole number, got 'two'"),
    ("cluster: {gpus_per_node: 2.5}\n", "cluster.gpus_per_node must be a positive whole number, got 2.5"),
    ("include: 5\n", "include takes a file name or a list of them, got 5"),
    ("num_layers: 2\nhidden_size: 256\nnum_layers: 4\n", "key 'num_layers' is written twice (lines 1 and 3): keep one"),
    ("cluster: {nodes: 1, nodes: 2}\n", "key 'nodes' is written twice (lines 1 and 1): keep one"),
], ids=["int", "choice", "true-for-a-value", "list-for-one", "list-choice", "cluster-int", "cluster-fraction",
        "include", "duplicate", "duplicate-in-cluster"])
def test_a_bad_value_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, text, message):
    path = _write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)
    assert cli_main(["argv", str(path)]) == 2
    assert one_error_line(capsys.readouterr().err) == f"error: {error.value}"


def _refusals(capsys, config, extra=(), sets=()) -> dict:
    """The sentence (or None) of each route that plans or starts a launch: `argv` (no extra flags),
    `estimate` (the extra flags as --set), scripts/launch.py --dry-run, and a launch on this machine
    that gets as far as torchrun (a stand-in that fails)."""
    import torch

    from megatron_fp4.launch import torchrun

    sentences = {}
    runs = {"estimate": lambda: cli_main(["estimate", str(config), *[f"--set={s}" for s in sets]]),
            "dry-run": lambda: torchrun.main(["--dry-run", str(config), *extra]),
            "launch": lambda: torchrun.main([str(config), *extra])}
    if not extra:
        runs["argv"] = lambda: cli_main(["argv", str(config)])
    with pytest.MonkeyPatch.context() as patch:  # a Hopper node with its GPUs
        for name in ("NNODES", "GPUS_PER_NODE", "RUN_ID", "SLURM_JOB_ID", "RUN_DIR"):
            patch.delenv(name, raising=False)
        patch.setenv("TORCHRUN", f"{sys.executable} -c 'raise SystemExit(9)'")
        patch.setenv("RUN_DIR", str(config.parent / "run"))
        patch.setattr(torch.cuda, "is_available", lambda: True)
        patch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
        for route, run in runs.items():
            status = run()
            err = capsys.readouterr().err
            sentences[route] = one_error_line(err)[len("error: "):] if status == 2 else status
    return sentences


def test_every_route_refuses_what_the_launch_refuses(tmp_path, capsys):
    # FP8 experts with the distributed optimizer's default checkpoint format: the launch adds --save.
    fp8 = _write(tmp_path, "fp8.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2_fp4_fp8.yaml'}\n"
                                       "dist_ckpt_optim_fully_reshardable: false\n")
    sentences = _refusals(capsys, fp8)
    assert set(sentences.values()) == {
        "--moe-fp4-experts fp8 with --use-distributed-optimizer saves and loads checkpoints only in the fully "
        "reshardable format (the default one stores optimizer state in parameter order, which differs from "
        "Megatron's grouped experts): add --dist-ckpt-optim-fully-reshardable."}, sentences
    # Layouts Megatron asserts on: experts over EP, EP x ETP x PP against the GPUs, batches against DP.
    proxy = _write(tmp_path, "proxy.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2_bf16.yaml'}\n")
    for flag, value, sentence in [
        ("num_experts", 15, "15 experts do not split over expert parallelism 2: --num-experts must be a multiple "
                            "of --expert-model-parallel-size."),
        ("expert_model_parallel_size", 4, "the launch's 2 GPU(s) (nodes x gpus_per_node) do not split into "
                                          "expert-tensor x expert x pipeline parallel groups of 1 x 4 x 1"),
        ("global_batch_size", 12, "--global-batch-size 12 is not a multiple of --micro-batch-size 4 x data "
                                  "parallelism 2"),
    ]:
        sentences = _refusals(capsys, proxy, [f"--{flag.replace('_', '-')}", str(value)], [f"{flag}={value}"])
        assert len(set(sentences.values())) == 1 and next(iter(sentences.values())).startswith(sentence), sentences
    # The GPUs a launch starts are the environment's when it sets them.
    import os

    from megatron_fp4.launch import torchrun

    os.environ["GPUS_PER_NODE"] = "3"
    try:
        assert torchrun.main(["--dry-run", str(proxy)]) == 2
    finally:
        del os.environ["GPUS_PER_NODE"]
    assert "the launch's 3 GPU(s) (nodes x gpus_per_node) do not split into expert-tensor" in capsys.readouterr().err


FLEX_DEEPEP = {"enable-deepep": "moe_enable_deepep: true\n", "backend-deepep": "moe_flex_dispatcher_backend: deepep\n"}


@pytest.mark.parametrize("backend", sorted(FLEX_DEEPEP))
def test_fp4_dispatch_through_flex_on_deepep_is_accepted_by_every_route(tmp_path, capsys, backend):
    """--moe-token-dispatcher-type flex with DeepEP (either spelling) and --moe-fp4-dispatch: argv, estimate and
    --dry-run plan it (DeepEP itself is checked where it runs, dispatch/deepep.py), and the estimator counts
    the packed payload (tests/estimator)."""
    from megatron_fp4.launch import torchrun

    path = _write(tmp_path, "flex.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2_fp4.yaml'}\n"
                                         f"moe_token_dispatcher_type: flex\n{FLEX_DEEPEP[backend]}")
    assert validate_config(load_config(path)) == FP4Options(dispatch=True)
    assert cli_main(["argv", str(path)]) == 0
    assert "--moe-token-dispatcher-type flex" in capsys.readouterr().out
    assert cli_main(["estimate", str(path)]) == 0
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUN_DIR", str(tmp_path / "run"))
        for name in ("NNODES", "GPUS_PER_NODE", "RUN_ID", "SLURM_JOB_ID"):
            patch.delenv(name, raising=False)
        assert torchrun.main(["--dry-run", str(path)]) == 0
    assert "--moe-fp4-dispatch" in capsys.readouterr().out


def test_every_route_refuses_what_the_fp4_flex_dispatch_does_not_serve(tmp_path, capsys):
    """Each refusal of the FP4 dispatch through flex, the same sentence on argv, estimate, --dry-run and a
    launch (the launch's extra flags, the estimate's --set)."""
    flex = _write(tmp_path, "flex.yaml", f"include: {CONFIGS / 'proxy' / 'gpus2_fp4.yaml'}\n"
                                         "moe_token_dispatcher_type: flex\nmoe_flex_dispatcher_backend: deepep\n")
    for extra, sets, sentence in [
        (["--moe-flex-dispatcher-backend", "ncclep"], ["moe_flex_dispatcher_backend=ncclep"],
         "--moe-fp4-dispatch through the flex dispatcher serves its DeepEP backend only (got "
         "--moe-flex-dispatcher-backend ncclep)."),
        (["--moe-fp4-dispatch-grad", "fp8"], ["moe_fp4_dispatch_grad=fp8"],
         "--moe-fp4-dispatch-grad fp8 is not served through the flex dispatcher: DeepEP's combine, which carries the "
         "dispatch's gradient back, is BF16 only; use --moe-fp4-dispatch-grad bf16."),
        (["--moe-fp4-telemetry"], ["moe_fp4_telemetry=true"],
         "--moe-fp4-telemetry is not served through the flex dispatcher yet (its byte counts are the alltoall "
         "dispatcher's rows): drop --moe-fp4-telemetry or use --moe-token-dispatcher-type alltoall."),
        (["--moe-router-padding-for-quantization"], ["moe_router_padding_for_quantization=true"],
         "--moe-fp4-dispatch through the flex dispatcher does not pad the experts' token counts as "
         "--moe-router-padding-for-quantization (or --moe-router-padding-for-fp8) asks: drop that flag."),
        (["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
         ["moe_expert_capacity_factor=1.0", "moe_pad_expert_input_to_capacity=true"],
         "--moe-pad-expert-input-to-capacity is not served by the flex dispatcher's DeepEP backend (megatron-core "
         "refuses it there too): drop it or use --moe-token-dispatcher-type alltoall."),
    ]:
        sentences = _refusals(capsys, flex, extra, sets)
        assert set(sentences.values()) == {sentence}, sentences
    # Without --bf16 (the config's own line switched off; the estimate's --set does the same).
    fp32 = _write(tmp_path, "fp32.yaml", f"include: {flex}\nbf16: false\n")
    sentences = _refusals(capsys, fp32)
    assert set(sentences.values()) == {
        "--moe-fp4-dispatch through the flex dispatcher needs --bf16: DeepEP's combine, which also carries the "
        "dispatch's gradient back, is BF16 only."}, sentences
    assert set(sentences) == {"argv", "estimate", "dry-run", "launch"}


def test_estimate_refuses_an_unknown_flag(capsys):
    assert cli_main(["estimate", str(CONFIGS / "proxy" / "gpus2.yaml"), "--set", "moe_fp4_dispach=true"]) == 2
    assert "unknown key 'moe_fp4_dispach': not a Megatron flag nor one of ours; did you mean moe_fp4_dispatch" in (
        one_error_line(capsys.readouterr().err))
