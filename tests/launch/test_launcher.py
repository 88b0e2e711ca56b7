"""The pretraining launcher (megatron_fp4.launch) on CPU: --help, the refusal path, the proxy
script's command line, and what the launcher builds from that command line (layer specs, mock data,
loss) short of the model itself (Megatron's MoE layers allocate CUDA buffers and streams when
built); the memory cap against a stand-in GPU."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.training import arguments as megatron_arguments
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import unset_global_variables

from megatron_fp4.experts import FP8Experts
from megatron_fp4.integration import FP4MoELayer
from megatron_fp4.launch import gpt, memory_cap, pretrain
from megatron_fp4.launch.arguments import parse_launcher_args
from megatron_fp4.options import FP4Options
from megatron_fp4.run_config import GPU_MEMORY_CAP_ENV
from support.entry_points import TORCHRUN, one_error_line

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "scripts" / "pretrain_gpt_fp4.py"
PROXY = ROOT / "scripts" / "train_proxy.sh"


def proxy_command(nproc: str, *extra: str, **env: str) -> list:
    """The launcher arguments train_proxy.sh builds (a dry run of scripts/launch.py)."""
    name = f"test_launcher_{uuid.uuid4().hex[:8]}"
    try:
        out = subprocess.run(
            ["bash", str(PROXY), nproc, *extra], capture_output=True, text=True, check=True, timeout=120,
            env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable, "RUN_NAME": name, **env},
        ).stdout
    finally:
        shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
    words = shlex.split(out.splitlines()[-1])
    assert words[:6] == [*TORCHRUN, "--standalone", "--nproc-per-node", nproc]
    assert words[6] == str(LAUNCHER)
    return words[7:]


@pytest.fixture
def launcher_argv(monkeypatch):
    """Set the command line (and torchrun's env) as a rank sees it; Megatron's globals are reset."""

    def _set(argv, world_size=1):
        monkeypatch.setattr(sys, "argv", [str(LAUNCHER), *argv])
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        monkeypatch.setenv("RANK", "0")
        unset_global_variables()

    yield _set
    unset_global_variables()


@pytest.mark.parametrize("entry_point", [[str(LAUNCHER)], ["-m", "megatron_fp4.launch"]], ids=["script", "module"])
def test_help_lists_our_flags_and_megatrons(entry_point):
    result = subprocess.run([sys.executable, *entry_point, "--help"], capture_output=True, text=True, timeout=120,
                            check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--moe-fp4-dispatch", "--moe-fp4-dispatch-grad {bf16,fp8}", "--moe-fp4-scale-rule {ceil,floor}",
                 "--num-experts", "--moe-token-dispatcher-type", "--expert-model-parallel-size", "--mtp-num-layers",
                 "--mock-data", "--tokenizer-type", "--transformer-impl"):
        assert flag in result.stdout, flag
    assert "Environment: MEGATRON_FP4_GPU_MEMORY_CAP_GIB=N caps" in " ".join(result.stdout.split())


def test_proxy_script_syntax_and_command_line():
    subprocess.run(["bash", "-n", str(PROXY)], check=True)
    argv = proxy_command("2", "--train-iters", "7")
    assert "--moe-fp4-dispatch" in argv
    assert argv[argv.index("--expert-model-parallel-size") + 1] == "2"
    assert argv[argv.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert argv[-2:] == ["--train-iters", "7"]  # extra arguments come last, so they win
    assert argv[argv.index("--save") + 1].endswith("checkpoints")  # checkpoints go to the run directory
    assert "--moe-fp4-dispatch" not in proxy_command("1", FP4="0")  # the same as PRECISION=bf16
    # One config per GPU count and precision (gpus<N>_<PRECISION>.yaml, fp4 by default), expert
    # parallelism = GPUs; other counts are refused by name.
    runs = {"1": proxy_command("1", PRECISION="fp4_fp8"), "4": proxy_command("4"),
            "8": proxy_command("8", PRECISION="bf16")}
    assert {n: a[a.index("--expert-model-parallel-size") + 1] for n, a in runs.items()} == {n: n for n in runs}
    assert "--moe-fp4-dispatch" in runs["1"] and runs["1"][runs["1"].index("--moe-fp4-experts") + 1] == "fp8"
    assert "--moe-fp4-dispatch" in runs["4"] and "--moe-fp4-dispatch" not in runs["8"]
    refused = subprocess.run(["bash", str(PROXY), "3"], capture_output=True, text=True, check=False, timeout=60,
                             env={**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable})
    assert refused.returncode == 2 and "no proxy config for 3 GPU(s)" in refused.stderr


def _proxy_on_a_machine_with(tmp_path, gpus: int, **env: str):
    """train_proxy.sh without N where nvidia-smi lists `gpus` GPUs (a stand-in; a dry run)."""
    bin_dir = tmp_path / f"bin{gpus}"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(gpus)))
    (bin_dir / "nvidia-smi").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("NPROC", "CUDA_VISIBLE_DEVICES", "RUN_NAME", "PRECISION")}
    return subprocess.run(["bash", str(PROXY)], capture_output=True, text=True, check=False, timeout=120,
                          env={**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DRY_RUN": "1",
                               "PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "ignored"), **env})


def test_the_main_job_takes_the_gpus_the_machine_has(tmp_path):
    one = _proxy_on_a_machine_with(tmp_path, 1)
    assert one.returncode == 0, one.stderr[-2000:]
    lines = one.stdout.splitlines()
    assert lines[0] == "train_proxy: 1 GPU (this machine's): configs/proxy/gpus1_fp4.yaml"  # what it chose
    words = shlex.split(lines[-1])
    assert words[words.index("--nproc-per-node") + 1] == words[words.index("--expert-model-parallel-size") + 1] == "1"
    assert "runs/gpus1_fp4_" in lines[1] and "ignored" not in lines[1]  # a new run directory of its own
    # A count without a config: one line naming the largest count that fits.
    three = _proxy_on_a_machine_with(tmp_path, 3)
    assert three.returncode == 2 and three.stdout == ""
    assert one_error_line(three.stderr) == ("error: the proxy runs on 1, 2, 4 or 8 GPUs and this machine has 3: "
                                           "scripts/train_proxy.sh 2 trains on 2 of them.")
    none = _proxy_on_a_machine_with(tmp_path, 0)
    assert none.returncode == 2 and one_error_line(none.stderr).startswith("error: DRY_RUN=1 finds no GPUs here")


def test_proxy_script_help_says_what_it_does():
    help_text = " ".join(subprocess.run(["bash", str(PROXY), "--help"], capture_output=True, text=True, check=True,
                                        timeout=60).stdout.split())
    configs = sorted((ROOT / "configs" / "proxy").glob("gpus*_*.yaml"))
    gpus = sorted({path.stem[len("gpus"):].split("_")[0] for path in configs}, key=int)
    assert f"N: {', '.join(gpus[:-1])} or {gpus[-1]} GPUs" in help_text
    precisions = help_text.split("PRECISION picks the config:")[1].split("TRAIN_ITERS")[0]
    assert set(re.findall(r"(\w+) \(", precisions)) == {path.stem.split("_", 1)[1] for path in configs}
    script = PROXY.read_text()
    for variable in ("NPROC", "PRECISION", "FP4", "TRAIN_ITERS", "MBS", "GBS", "RUN_NAME", "DRY_RUN", "PYTHON"):
        assert variable in help_text and "${" + variable in script, variable


REFUSED_ARGV = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "64",
                "--max-position-embeddings", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
                "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--num-experts", "4",
                "--moe-token-dispatcher-type", "allgather", "--moe-fp4-dispatch"]


@pytest.mark.parametrize("cuda, sentence", [
    (True, "error: --moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall or flex (got allgather)"),
    (False, "error: --moe-fp4-dispatch, --moe-fp4-experts fp8, --moe-fp4-linears fp8, --moe-fp4-fused-attention and "
            "--moe-fp4-recompute-experts need CUDA GPUs"),
], ids=["with-cuda", "without-cuda"])  # (an id "gpu" would mark it GPU-only)
def test_refusal_stops_the_run_with_one_sentence(launcher_argv, capsys, monkeypatch, cuda, sentence):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)  # the validation's view of this machine
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))  # Hopper
    launcher_argv(REFUSED_ARGV)
    with pytest.raises(SystemExit) as stop:
        pretrain.main()
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # before Megatron's validation prints its argument dump
    assert one_error_line(err).startswith(sentence)


def test_the_script_refuses_in_one_line():
    # This machine as it is: without CUDA the first refusal is the missing GPU, with it the dispatcher.
    result = subprocess.run([sys.executable, str(LAUNCHER), *REFUSED_ARGV], capture_output=True, text=True,
                            timeout=300, check=False, cwd=ROOT, env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"})
    assert result.returncode == 2 and result.stdout == ""
    one_error_line(result.stderr)  # no import-time notices of Megatron or torch before it


def test_context_parallelism_is_refused_by_the_launcher(launcher_argv, capsys, monkeypatch):
    # A GPU machine as Megatron's validation (which asks the GPU's architecture with CP) and ours see it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))  # Hopper
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # as scripts/launch.py sets it
    # (a dry run of scripts/launch.py refuses it already, so the flag is added to its command here)
    launcher_argv([*proxy_command("2"), "--context-parallel-size", "2"], world_size=4)
    with pytest.raises(SystemExit) as stop:
        pretrain.main()
    assert stop.value.code == 2
    assert "error: megatron_fp4's launcher does not slice batches for context parallelism" in capsys.readouterr().err


@pytest.mark.parametrize("fp4", [True, False])
def test_proxy_specs_dense_first_then_moe_and_mtp(launcher_argv, one_rank, fp4):
    launcher_argv(proxy_command("2", FP4="1" if fp4 else "0"), world_size=2)
    args = parse_launcher_args()
    assert args.moe_fp4_dispatch is fp4 and args.transformer_impl == "local"
    decoder, mtp = gpt.build_specs(args, core_transformer_config_from_args(args))

    moe_class = FP4MoELayer if fp4 else MoELayer
    mlps = [layer.submodules.mlp for layer in decoder.layer_specs]
    assert len(mlps) == 6
    assert getattr(mlps[0], "func", None) not in (MoELayer, FP4MoELayer)  # the first layer is dense
    assert [m.func for m in mlps[1:]] == [moe_class] * 5
    mtp_layers = mtp.layer_specs
    assert len(mtp_layers) == 1
    assert mtp_layers[0].submodules.mtp_model_layer.submodules.mlp.func is moe_class
    if fp4:
        assert mlps[1].keywords["fp4_options"] == FP4Options(dispatch=True, scale_rule="ceil", dispatch_grad="bf16")


def test_proxy_specs_with_fp8_experts(launcher_argv, one_rank):
    launcher_argv(proxy_command("2", "--moe-fp4-experts", "fp8"), world_size=2)
    args = parse_launcher_args()
    decoder, mtp = gpt.build_specs(args, core_transformer_config_from_args(args))
    moe_layers = [layer.submodules.mlp for layer in decoder.layer_specs[1:]]
    moe_layers.append(mtp.layer_specs[0].submodules.mtp_model_layer.submodules.mlp)
    for moe in moe_layers:
        assert moe.func is FP4MoELayer
        assert moe.keywords["submodules"].experts.func is FP8Experts


def test_mock_data_batches_and_loss(launcher_argv):
    launcher_argv(proxy_command("1", "--micro-batch-size", "2", "--train-iters", "3", "--eval-iters", "1"))
    args = parse_launcher_args()
    train, _, _ = gpt.train_valid_test_datasets_provider([6, 2, 2])
    sample = train[0]
    assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}  # no mask: built in attention
    assert sample["tokens"].shape == (args.seq_length,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])

    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    loss, num_tokens, report = gpt.loss_func(mask, per_token)
    assert loss.item() == 13.0 and num_tokens.item() == 4
    assert report["lm loss"].tolist() == [13.0, 4.0]


def test_memory_fraction_of_a_cap():
    total = 140 * 2**30
    assert memory_cap.memory_fraction(14, total) == 0.1
    assert memory_cap.memory_fraction(1, 2**30) == 1.0  # the whole GPU is allowed
    # A nominal "80 GB" cap on an H100 that reports 79.2 GiB: the whole GPU, not a refusal.
    assert memory_cap.memory_fraction(80, 85_032_697_856) == 1.0
    for bad in (0, -1, float("nan")):
        with pytest.raises(ValueError, match="positive number of GiB"):
            memory_cap.memory_fraction(bad, total)
    with pytest.raises(ValueError, match="a 200 GiB cap is more than this GPU's 140.0 GiB"):
        memory_cap.memory_fraction(200, total)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A visible 16 GiB GPU whose set_device / memory-fraction calls are recorded, not made."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))  # Hopper
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 16 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.append(("fraction", fraction, device)))
    return calls


def test_memory_cap_comes_from_the_environment(monkeypatch, fake_gpu, capsys):
    monkeypatch.delenv(GPU_MEMORY_CAP_ENV, raising=False)
    memory_cap.apply_memory_cap(1)
    assert fake_gpu == []  # no variable, no cap

    monkeypatch.setenv(GPU_MEMORY_CAP_ENV, "14")
    monkeypatch.setenv("RANK", "3")
    memory_cap.apply_memory_cap(1)
    assert fake_gpu == [("set_device", 1), ("fraction", 14 / 16, 1)]
    assert "rank 3: capping this process's CUDA memory at 14 GiB of 16.0 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("value, message", [("20", "a 20 GiB cap is more than this GPU's 16.0 GiB."),
                                            ("0", "the cap must be a positive number of GiB, got 0.0."),
                                            ("lots", "could not convert string to float")])
def test_memory_cap_refusals(monkeypatch, fake_gpu, capsys, value, message):
    monkeypatch.setenv(GPU_MEMORY_CAP_ENV, value)
    with pytest.raises(SystemExit) as stop:
        memory_cap.apply_memory_cap(0)
    assert stop.value.code == 2 and fake_gpu == []
    assert f"error: {GPU_MEMORY_CAP_ENV}={value}: {message}" in capsys.readouterr().err


def test_memory_cap_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setenv(GPU_MEMORY_CAP_ENV, "14")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        memory_cap.apply_memory_cap(0)
    assert stop.value.code == 2 and "no CUDA GPU is visible" in capsys.readouterr().err


def test_memory_cap_goes_to_the_local_rank(launcher_argv, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    launcher_argv(proxy_command("2"), world_size=2)
    assert parse_launcher_args().local_rank == 1  # what main() passes to apply_memory_cap
