"""Single-node, multi-node and SLURM launches, checked by dry runs that print the torchrun command,
and --enforce-memory-cap (also through a stand-in torchrun that prints what it was given). The
launches run scripts/launch.py's main (megatron_fp4.launch.torchrun.main) in this process, with
the environment and working directory a launch from the repository root has; the script itself
runs as a process where that is what is checked (its one-line errors, the SLURM wrapper)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fp4.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.py"
SBATCH = ROOT / "scripts" / "slurm_launch.sbatch"
CONFIG_671B = "configs/deepseek_v3_671b/fp4_mla_up_proj.yaml"
# The launcher's own variables: a launch sees only those a test gives it.
LAUNCH_ENV = ("NNODES", "GPUS_PER_NODE", "RUN_ID", "RUN_DIR", "SLURM_JOB_ID", "MASTER_ADDR", "TORCHRUN", "NODE_RANK")


def _launch_process(config, *extra, **env):
    """scripts/launch.py as a process of its own, from the repository root."""
    run_env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return subprocess.run([sys.executable, str(LAUNCH), config, *extra], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**run_env, **env}, check=False)


@pytest.fixture
def launch(monkeypatch, capsys):
    """launch(config, *extra, **env): scripts/launch.py's main in this process, from the repository
    root, with only the given launcher variables set; returns a CompletedProcess (exit status, what
    it printed). An exit with a message (SystemExit("error: ...")) counts as status 1 with the
    message on stderr, as Python reports it for the script."""

    def run(config, *extra, **env):
        capsys.readouterr()
        with monkeypatch.context() as patched:
            patched.chdir(ROOT)
            for key in LAUNCH_ENV:
                patched.delenv(key, raising=False)
            for key, value in env.items():
                patched.setenv(key, value)
            try:
                code = torchrun.main([config, *extra])
            except SystemExit as stop:
                code = stop.code
        out, err = capsys.readouterr()
        if isinstance(code, str):
            code, err = 1, err + code + "\n"
        return subprocess.CompletedProcess([config, *extra], code or 0, out, err)

    return run


@pytest.fixture
def dry_run(launch):
    return lambda config, *extra, **env: launch(config, "--dry-run", *extra, **env)


def _torchrun_words(result):
    assert result.returncode == 0, result.stderr[-2000:]
    return shlex.split(result.stdout.strip().splitlines()[-1])


def test_single_node_standalone_with_run_directory(dry_run, tmp_path):
    result = dry_run("configs/proxy/gpus4.yaml", "--train-iters", "5", RUN_DIR=str(tmp_path / "run"))
    words = _torchrun_words(result)
    assert words[:4] == ["torchrun", "--standalone", "--nproc-per-node", "4"]
    assert words[words.index("--save") + 1] == str(tmp_path / "run" / "checkpoints")
    assert words[-2:] == ["--train-iters", "5"]
    assert "NCCL_NVLS_ENABLE=0" in result.stdout and "CUDA_DEVICE_MAX_CONNECTIONS=1" in result.stdout
    assert not (tmp_path / "run").exists()  # a dry run starts nothing and writes nothing


def test_multi_node_uses_c10d_rendezvous(dry_run):
    words = _torchrun_words(dry_run(CONFIG_671B, NNODES="32", MASTER_ADDR="node001", RUN_ID="job42"))
    assert words[:11] == ["torchrun", "--nnodes", "32", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "node001:29500", "--rdzv-id", "job42"]
    assert "--moe-fp4-dispatch" in words
    assert words[words.index("--expert-model-parallel-size") + 1] == "32"


def test_multi_node_refuses_without_rendezvous_id_or_host(dry_run):
    no_id = dry_run(CONFIG_671B, NNODES="2", MASTER_ADDR="node001")
    assert no_id.returncode == 2 and "needs RUN_ID" in no_id.stderr
    no_host = dry_run(CONFIG_671B, NNODES="2", RUN_ID="x")
    assert no_host.returncode != 0 and "needs MASTER_ADDR" in (no_host.stderr + no_host.stdout)


def test_bad_config_is_one_line_error(tmp_path):
    # The script as a process: its exit status and stderr are what a user meets.
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_layer: 2\n")
    result = _launch_process(str(bad), "--dry-run")
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
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "777", "SLURM_SUBMIT_DIR": str(ROOT), "DRY_RUN": "1",
           "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(SBATCH), CONFIG_671B, "--train-iters", "3"], capture_output=True,
                            text=True, timeout=120, env=env, check=False)
    words = _torchrun_words(result)
    assert words[1:3] == ["--nnodes", "2"]
    assert words[words.index("--rdzv-endpoint") + 1] == "gpu-a01:29500"
    assert words[words.index("--rdzv-id") + 1] == "777"
    assert words[-2:] == ["--train-iters", "3"]
    assert "runs/fp4_mla_up_proj_777" in result.stdout


def test_memory_cap_is_opt_in_and_comes_from_the_config(launch, dry_run, tmp_path):
    help_text = launch("--help")
    assert help_text.returncode == 0
    assert "--enforce-memory-cap" in help_text.stdout and "cluster.gpu_memory_gib" in help_text.stdout
    memcap = "configs/proxy/memcap_bf16_attn.yaml"
    capped = dry_run(memcap, "--enforce-memory-cap", "--train-iters", "3", RUN_DIR=str(tmp_path / "run"))
    words = _torchrun_words(capped)
    assert words[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    assert "--enforce-memory-cap" not in words and words[-2:] == ["--train-iters", "3"]
    assert "MEGATRON_FP4_GPU_MEMORY_CAP_GIB=14" in capped.stdout.splitlines()[1].split()  # the "env:" line
    # Without the flag no cap, even if the caller's shell still has the variable.
    uncapped = dry_run(memcap, RUN_DIR=str(tmp_path / "run"), MEGATRON_FP4_GPU_MEMORY_CAP_GIB="10")
    assert uncapped.returncode == 0 and "MEGATRON_FP4_GPU_MEMORY_CAP_GIB" not in uncapped.stdout


def test_memory_cap_reaches_the_training_processes(launch, tmp_path):
    # A stand-in torchrun that prints the variable, run for real (not a dry run).
    fake_torchrun = shlex.join([sys.executable, "-c", "import os; print('cap=' + os.environ.get("
                                "'MEGATRON_FP4_GPU_MEMORY_CAP_GIB', 'none'))"])
    for flags, expected in ((["--enforce-memory-cap"], "cap=14"), ([], "cap=none")):
        result = launch("configs/proxy/memcap_fp4_fp8_attn.yaml", *flags, TORCHRUN=fake_torchrun,
                         RUN_DIR=str(tmp_path / "run"), MEGATRON_FP4_GPU_MEMORY_CAP_GIB="10")
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.strip().splitlines()[-1] == expected


def test_memory_cap_needs_the_configs_gpu_memory(dry_run, tmp_path):
    config = tmp_path / "no_memory.yaml"
    config.write_text("num_layers: 2\ncluster: {nodes: 1, gpus_per_node: 2}\n")
    result = dry_run(str(config), "--enforce-memory-cap")
    assert result.returncode == 2
    assert f"error: --enforce-memory-cap needs cluster.gpu_memory_gib in {config}" in result.stderr


def test_dry_run_refuses_what_a_launch_refuses(dry_run, tmp_path):
    # The launch's own validation (megatron_fp4.options), without this machine's checks: a dry run
    # plans for another machine. A refusal prints no torchrun command.
    allgather = tmp_path / "fp4_allgather.yaml"
    allgather.write_text(f"include: {ROOT / 'configs' / 'proxy' / 'gpus2.yaml'}\nmoe_fp4_dispatch: true\n"
                         "moe_token_dispatcher_type: allgather\n")
    refused = dry_run(str(allgather))
    assert refused.returncode == 2 and refused.stdout == ""
    assert _errors(refused) == ["error: --moe-fp4-dispatch needs --moe-token-dispatcher-type alltoall (got allgather): "
                                "it replaces that dispatcher's all-to-all."]
    # Extra flags are validated with the config's.
    cache = dry_run("configs/proxy/gpus2.yaml", "--moe-fp4-dispatch", "--moe-fp4-cache")
    assert cache.returncode == 2 and cache.stdout == ""
    [error] = _errors(cache)
    assert error.startswith("error: --moe-fp4-cache serves only the recompute of whole MoE layers")


def _errors(result):
    """The error lines (stderr also has the warnings of importing Megatron without its kernels)."""
    assert "Traceback" not in result.stderr
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]
