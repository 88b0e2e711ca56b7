"""Single-node, multi-node and SLURM launches, checked by dry runs that print the torchrun command,
and --enforce-memory-cap (also through a stand-in torchrun that prints what it was given)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from megatron_fp4.launch import torchrun
from support.entry_points import TORCHRUN, one_error_line

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.py"
SBATCH = ROOT / "scripts" / "slurm_launch.sbatch"
CONFIG_671B = "configs/deepseek_v3_671b/fp4_mla_up_proj.yaml"


def _launch(config, *extra, **env):
    ours = ("NNODES", "GPUS_PER_NODE", "RUN_ID", "RUN_DIR", "SLURM_JOB_ID", "MASTER_ADDR", "TORCHRUN", "NODE_RANK")
    run_env = {k: v for k, v in os.environ.items() if k not in ours}
    return subprocess.run([sys.executable, str(LAUNCH), config, *extra], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**run_env, **env}, check=False)


def _dry_run(config, *extra, **env):
    return _launch(config, "--dry-run", *extra, **env)


def _torchrun_words(result):
    assert result.returncode == 0, result.stderr[-2000:]
    return shlex.split(result.stdout.strip().splitlines()[-1])


def test_single_node_standalone_with_run_directory(tmp_path):
    result = _dry_run("configs/proxy/gpus4.yaml", "--train-iters", "5", RUN_DIR=str(tmp_path / "run"))
    words = _torchrun_words(result)
    assert words[:6] == [*TORCHRUN, "--standalone", "--nproc-per-node", "4"]
    assert words[words.index("--save") + 1] == str(tmp_path / "run" / "checkpoints")
    assert words[-2:] == ["--train-iters", "5"]
    assert "NCCL_NVLS_ENABLE=0" in result.stdout and "CUDA_DEVICE_MAX_CONNECTIONS=1" in result.stdout
    assert not (tmp_path / "run").exists()  # a dry run starts nothing and writes nothing


def test_multi_node_uses_c10d_rendezvous():
    words = _torchrun_words(_dry_run(CONFIG_671B, NNODES="32", MASTER_ADDR="node001", RUN_ID="job42"))
    assert words[:13] == [*TORCHRUN, "--nnodes", "32", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "node001:29500", "--rdzv-id", "job42"]
    assert "--moe-fp4-dispatch" in words
    assert words[words.index("--expert-model-parallel-size") + 1] == "32"


def test_multi_node_names_every_missing_variable_at_once():
    neither = _dry_run(CONFIG_671B, NNODES="2")
    assert neither.returncode == 2 and neither.stdout == ""
    assert one_error_line(neither.stderr) == (
        "error: a multi-node launch (2 nodes) needs RUN_ID (the same on every node; SLURM_JOB_ID serves) and "
        "MASTER_ADDR (the rendezvous host), set on every node.")
    assert torchrun.missing_multi_node_variables({"SLURM_JOB_ID": "7"}) == ["MASTER_ADDR (the rendezvous host)"]
    assert torchrun.missing_multi_node_variables({"RUN_ID": "x", "MASTER_ADDR": "node001"}) == []


def test_bad_config_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layer: 2\n")
    result = _dry_run(str(bad))
    assert result.returncode == 2 and "did you mean num_layers" in result.stderr
    assert "Traceback" not in result.stderr


def test_slurm_wrapper_runs_launch_on_every_node(tmp_path):
    # Stand-ins for SLURM's commands: scontrol lists the nodes, srun runs the task once (as node 0).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a01\\ngpu-a02\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nshift\nexec env SLURM_NODEID=0 "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[01-02]",
           "SLURM_JOB_NUM_NODES": "32", "SLURM_JOB_ID": "777", "SLURM_SUBMIT_DIR": str(ROOT), "DRY_RUN": "1",
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SBATCH), CONFIG_671B, "--train-iters", "3"], capture_output=True,
                            text=True, timeout=120, env=env, check=False)
    words = _torchrun_words(result)
    assert words[:5] == [*TORCHRUN, "--nnodes", "32"]  # the config's layout: 32 nodes of 8 GPUs
    assert words[words.index("--rdzv-endpoint") + 1] == "gpu-a01:29500"
    assert words[words.index("--rdzv-id") + 1] == "777"
    assert words[-2:] == ["--train-iters", "3"]
    assert "runs/fp4_mla_up_proj_777" in result.stdout


def test_memory_cap_is_opt_in_and_comes_from_the_config(tmp_path):
    help_text = subprocess.run([sys.executable, str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60,
                               check=True).stdout
    assert "--enforce-memory-cap" in help_text and "cluster.gpu_memory_gib" in help_text
    memcap = "configs/proxy/memcap_bf16_attn.yaml"
    capped = _dry_run(memcap, "--enforce-memory-cap", "--train-iters", "3", RUN_DIR=str(tmp_path / "run"))
    words = _torchrun_words(capped)
    assert words[:6] == [*TORCHRUN, "--standalone", "--nproc-per-node", "2"]
    assert "--enforce-memory-cap" not in words and words[-2:] == ["--train-iters", "3"]
    assert "MEGATRON_FP4_GPU_MEMORY_CAP_GIB=14" in capped.stdout.splitlines()[1].split()  # the "env:" line
    # Without the flag no cap, even if the caller's shell still has the variable.
    uncapped = _dry_run(memcap, RUN_DIR=str(tmp_path / "run"), MEGATRON_FP4_GPU_MEMORY_CAP_GIB="10")
    assert uncapped.returncode == 0 and "MEGATRON_FP4_GPU_MEMORY_CAP_GIB" not in uncapped.stdout


def test_memory_cap_reaches_the_training_processes(tmp_path):
    # A stand-in torchrun that prints the variable, run for real (not a dry run).
    fake_torchrun = shlex.join([sys.executable, "-c", "import os; print('cap=' + os.environ.get("
                                "'MEGATRON_FP4_GPU_MEMORY_CAP_GIB', 'none'))"])
    for flags, expected in ((["--enforce-memory-cap"], "cap=14"), ([], "cap=none")):
        result = _launch("configs/proxy/memcap_bf16_attn.yaml", *flags, TORCHRUN=fake_torchrun,
                         RUN_DIR=str(tmp_path / "run"), MEGATRON_FP4_GPU_MEMORY_CAP_GIB="10")
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == expected


def test_memory_cap_needs_the_configs_gpu_memory(tmp_path):
    config = tmp_path / "no_memory.yaml"
    config.write_text("num_layers: 2\ncluster: {nodes: 1, gpus_per_node: 2}\n")
    result = _dry_run(str(config), "--enforce-memory-cap")
    assert result.returncode == 2
    assert f"error: --enforce-memory-cap needs cluster.gpu_memory_gib in {config}" in result.stderr


def test_dry_run_refuses_what_a_launch_refuses(tmp_path):
    # The launch's own validation (megatron_fp4.options), without this machine's checks: a dry run
    # plans for another machine. A refusal prints no torchrun command.
    allgather = tmp_path / "fp4_allgather.yaml"
    allgather.write_text(f"include: {ROOT / 'configs' / 'proxy' / 'gpus2.yaml'}\nmoe_fp4_dispatch: true\n"
                         "moe_token_dispatcher_type: allgather\n")
    refused = _dry_run(str(allgather))
    assert refused.returncode == 2 and refused.stdout == ""
    # The sentence alone: nothing of Megatron's or torch's import-time notices.
    assert one_error_line(refused.stderr) == ("error: --moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall "
                                              "or flex (got allgather): it replaces those dispatchers' token exchange.")
    # Extra flags are validated with the config's.
    cache = _dry_run("configs/proxy/gpus2_bf16.yaml", "--moe-fp4-dispatch", "--moe-fp4-cache")
    assert cache.returncode == 2 and cache.stdout == ""
    assert one_error_line(cache.stderr).startswith("error: --moe-fp4-cache serves only the recompute of whole MoE")


def _launch_here(monkeypatch, tmp_path, config, torchrun_code=None):
    """scripts/launch.py's main in this process (not a dry run): RUN_DIR in tmp_path; a stand-in
    torchrun (Python code) if given."""
    for name in ("NNODES", "GPUS_PER_NODE", "RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    if torchrun_code is not None:
        monkeypatch.setenv("TORCHRUN", shlex.join([sys.executable, "-c", torchrun_code]))
    return torchrun.main([config])


def test_a_launch_checks_this_machine_before_torchrun(monkeypatch, tmp_path, capsys):
    # Unlike a dry run, a launch runs the machine's checks: here, a node without CUDA GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _launch_here(monkeypatch, tmp_path, "configs/proxy/gpus2_fp4.yaml", "raise SystemExit(9)") == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("error: --moe-fp4-dispatch, --moe-fp4-experts fp8, --moe-fp4-linears fp8, "
                                 "--moe-fp4-fused-attention and --moe-fp4-recompute-experts need CUDA GPUs: their "
                                 "Triton kernels, FP8 GEMMs, fused attention kernels and Megatron's activation "
                                 "checkpoint run only there.\n")
    assert not (tmp_path / "run").exists()  # torchrun never started


def test_a_refusal_in_the_training_processes_ends_the_output(monkeypatch, tmp_path, capsys):
    # What torchrun prints when its processes refuse: their sentence, then its own report and traceback.
    ranks = ("import sys; print('error: --moe-fp4-cache needs --moe-fp4-dispatch.'); "
             "print('error: --moe-fp4-cache needs --moe-fp4-dispatch.'); "
             "print('Traceback (most recent call last):'); print('ChildFailedError: exitcode 2'); sys.exit(1)")
    assert _launch_here(monkeypatch, tmp_path, "configs/proxy/gpus1_bf16.yaml", ranks) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "ChildFailedError: exitcode 2"  # the terminal saw all of it, as the log did
    assert err == "error: --moe-fp4-cache needs --moe-fp4-dispatch.\n"  # and then the sentence, last
    assert (tmp_path / "run" / "train_node0.log").read_text().splitlines()[-1] == "ChildFailedError: exitcode 2"
    # A failure without a refusal keeps torchrun's exit status.
    assert _launch_here(monkeypatch, tmp_path, "configs/proxy/gpus1_bf16.yaml", "raise SystemExit(3)") == 3


def _words(out: str) -> list:
    return shlex.split(out.strip().splitlines()[-1])


def test_a_configs_own_load_is_kept(monkeypatch, tmp_path, capsys):
    # A fine-tuning config names the checkpoint to start from and no save: the launcher saves into
    # the run directory and adds no --load of its own (argparse keeps the last one).
    config = tmp_path / "finetune.yaml"
    config.write_text(f"include: {ROOT / 'configs' / 'proxy' / 'gpus2_bf16.yaml'}\nload: /ckpt/base\nfinetune: true\n")
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    assert torchrun.main(["--dry-run", str(config)]) == 0
    out = capsys.readouterr().out
    words = _words(out)
    assert [words[i + 1] for i, word in enumerate(words) if word == "--load"] == ["/ckpt/base"]
    assert words[words.index("--save") + 1] == str(tmp_path / "run" / "checkpoints") and "--finetune" in words
    assert out.splitlines()[0].endswith(f"loads /ckpt/base, saves {tmp_path / 'run' / 'checkpoints'}")
    # The same for a load given as an extra flag; without any, the run resumes from its own directory.
    assert torchrun.main(["--dry-run", "configs/proxy/gpus2_bf16.yaml", "--load=/ckpt/other"]) == 0
    words = _words(capsys.readouterr().out)
    assert "--load" not in words and words[-1] == "--load=/ckpt/other" and "--save" in words
    assert torchrun.main(["--dry-run", "configs/proxy/gpus2_bf16.yaml"]) == 0
    words = _words(capsys.readouterr().out)
    assert words[words.index("--load") + 1] == words[words.index("--save") + 1] == str(tmp_path / "run" / "checkpoints")


def test_two_launches_in_the_same_second_get_their_own_run_directories(monkeypatch, tmp_path, capsys):
    for name in ("RUN_DIR", "RUN_ID", "SLURM_JOB_ID", "NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torchrun, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(torchrun, "_now", lambda: "20260101_000000")  # one second for both
    monkeypatch.setenv("TORCHRUN", shlex.join([sys.executable, "-c", "pass"]))
    for _ in range(2):
        assert torchrun.main(["configs/proxy/gpus1_bf16.yaml"]) == 0
    first, second = tmp_path / "runs" / "gpus1_bf16_20260101_000000", tmp_path / "runs" / "gpus1_bf16_20260101_000000_2"
    assert sorted((tmp_path / "runs").iterdir()) == [first, second]
    for run_dir in (first, second):  # each saves to and resumes from its own checkpoints only
        words = shlex.split((run_dir / "command.txt").read_text())
        assert words[words.index("--save") + 1] == words[words.index("--load") + 1] == str(run_dir / "checkpoints")
    capsys.readouterr()
    assert torchrun.main(["--dry-run", "configs/proxy/gpus1_bf16.yaml"]) == 0  # a plan names the next free one
    assert f"run dir {first}_3," in capsys.readouterr().out


def test_a_launch_without_gpus_refuses_stock_configs_too(monkeypatch, tmp_path, capsys):
    # Megatron's training needs a CUDA GPU per process; without them torchrun's processes would each
    # end in Megatron's "requires CUDA" assertion after their argument dumps (~900 lines).
    for name in ("RUN_DIR", "RUN_ID", "SLURM_JOB_ID", "NNODES", "GPUS_PER_NODE", "TORCHRUN", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torchrun, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(torchrun, "torchrun_argv", lambda *a: [sys.executable, "-c", "raise SystemExit(9)"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torchrun.main(["configs/proxy/gpus2_bf16.yaml"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and one_error_line(err) == (
        "error: this launch trains on CUDA GPUs (2 process(es) on this node, one per GPU) and torch finds none on "
        "this machine: run it where the GPUs are (--dry-run prints its command here).")
    assert not (tmp_path / "runs").exists()  # no run directory left behind
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (9, 0))
    assert torchrun.main(["configs/proxy/gpus2_bf16.yaml"]) == 2
    err = capsys.readouterr().err
    assert "torch finds 1 on this machine: run it on a node with 2, or choose a config for 1." in err
    assert not (tmp_path / "runs").exists()


def test_dry_run_refuses_unknown_and_wrong_flags_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RUN_DIR", str(tmp_path / "run"))
    for extra, sentence in [
        (["--moe-fp4-dispach"], "error: extra flags: unknown flag --moe-fp4-dispach: not a Megatron flag nor one of "
                                "ours; did you mean --moe-fp4-dispatch, --moe-fp4-dispatch-grad?"),
        (["--bogus-flag", "7"], "error: extra flags: unknown flag --bogus-flag: not a Megatron flag nor one of ours"),
        (["--micro-batch-size", "four"], "error: extra flags: argument --micro-batch-size: invalid int value: 'four'"),
    ]:
        assert torchrun.main(["--dry-run", "configs/proxy/gpus2_bf16.yaml", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and one_error_line(err) == sentence
