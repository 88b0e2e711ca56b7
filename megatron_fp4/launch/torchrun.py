"""Launch scripts/pretrain_gpt_fp4.py from a YAML run config, on one node or many (torchrun).

    scripts/launch.py configs/proxy/gpus2.yaml [extra launcher flags ...]
    NNODES=32 MASTER_ADDR=node001 scripts/launch.py configs/deepseek_v3_671b/fp4_mla_up_proj.yaml
    scripts/launch.py --dry-run CONFIG       # print the environment and the torchrun command only
    scripts/launch.py --enforce-memory-cap CONFIG   # cap each GPU's memory at cluster.gpu_memory_gib

Nodes and GPUs per node come from the config's `cluster` section; NNODES / GPUS_PER_NODE override
them. One node: `torchrun --standalone`. Several: c10d rendezvous at MASTER_ADDR:MASTER_PORT with
the run's id, the same command on every node (scripts/slurm_launch.sbatch runs it through srun).
The run directory (RUN_DIR, default runs/<config>_<RUN_ID or time>) gets the command line, this
node's log and the checkpoints (--save/--load there unless the config names its own).
Extra flags go after the config's, so they win. The config and the extra flags are validated as a
launch validates them (megatron_fp4.options) before torchrun starts: a dry run without this
machine's checks (it may plan for another one), a launch with them (a GPU for the --moe-fp4-*
flags, Hopper for FP8 experts, the megatron-core release). A refusal, also one from the training
processes, ends the output with its one sentence and exit status 2.
torchrun is this interpreter's (`python -m torch.distributed.run`; TORCHRUN replaces it), so a
virtual environment works without being activated.
With --enforce-memory-cap every training process caps PyTorch's CUDA allocator at the config's
cluster.gpu_memory_gib (passed as MEGATRON_FP4_GPU_MEMORY_CAP_GIB, which the launcher otherwise
clears; scripts/pretrain_gpt_fp4.py applies it before its first CUDA allocation); going past it is
Megatron's usual torch.OutOfMemoryError. Memory outside that allocator (CUDA context, NCCL) is not
capped.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..console import fail, quiet_third_party_notices
from ..options import Environment, UnsupportedConfiguration
from ..run_config import GPU_MEMORY_CAP_ENV, ConfigError, load_config, validate_config

# The checkout this package runs from: run directories and the training entry point live there.
REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "scripts" / "pretrain_gpt_fp4.py"

# What the public Megatron MoE recipes set; NVLink multicast stays off on shared hosts.
RECIPE_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_IB_TIMEOUT": "19",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "PYTHONUNBUFFERED": "1",
}
DEFAULT_SAVE_INTERVAL = 1000

# Always forced, whatever the caller's environment says (see RECIPE_ENV).
FORCED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="scripts/launch.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML run config (configs/...)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and extra flags as a launch does (without this machine's checks), "
                             "print the environment and the torchrun command, start nothing")
    parser.add_argument("--enforce-memory-cap", action="store_true",
                        help="cap each training process's CUDA memory (PyTorch's caching allocator) at the "
                             f"config's cluster.gpu_memory_gib, through {GPU_MEMORY_CAP_ENV}; an allocation "
                             "past it raises torch.OutOfMemoryError. Default: no cap")
    args, extra = parser.parse_known_args(argv)
    return args, extra


def missing_multi_node_variables(env: dict) -> list:
    """What a multi-node launch needs from the environment and `env` lacks, all of it."""
    needed = {"RUN_ID": "RUN_ID (the same on every node; SLURM_JOB_ID serves)",
              "MASTER_ADDR": "MASTER_ADDR (the rendezvous host)"}
    present = {"RUN_ID": env.get("RUN_ID") or env.get("SLURM_JOB_ID"), "MASTER_ADDR": env.get("MASTER_ADDR")}
    return [text for name, text in needed.items() if not present[name]]


def torchrun_argv(nnodes: int, gpus_per_node: int, run_id: str, env: dict) -> list:
    torchrun = shlex.split(env["TORCHRUN"]) if env.get("TORCHRUN") else [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1:
        return [*torchrun, "--standalone", "--nproc-per-node", str(gpus_per_node)]
    endpoint = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    return [*torchrun, "--nnodes", str(nnodes), "--nproc-per-node", str(gpus_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]


def main(argv=None) -> int:
    quiet_third_party_notices()  # before the config's flags are checked against Megatron's parser
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        return fail(str(err))
    env = {**RECIPE_ENV, **os.environ}
    env.update({key: RECIPE_ENV[key] for key in FORCED_ENV})
    nnodes = int(env.get("NNODES", config.cluster.get("nodes", 1)))
    gpus_per_node = int(env.get("GPUS_PER_NODE", config.cluster.get("gpus_per_node", 1)))
    if nnodes > 1 and (missing := missing_multi_node_variables(env)):  # every node must name the same rendezvous
        return fail(f"a multi-node launch ({nnodes} nodes) needs {' and '.join(missing)}, set on every node.")
    run_id = env.get("RUN_ID") or env.get("SLURM_JOB_ID") or time.strftime("%Y%m%d_%H%M%S")
    # Absolute: the trainer runs from the repository root, the caller may not.
    run_dir = Path(env.get("RUN_DIR", REPO / "runs" / f"{Path(args.config).stem}_{run_id}")).resolve()
    node = env.get("NODE_RANK", env.get("SLURM_NODEID", "0"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(GPU_MEMORY_CAP_ENV, None)  # the flag alone decides, not a variable left in the caller's shell
    if args.enforce_memory_cap:
        if "gpu_memory_gib" not in config.cluster:
            return fail(f"--enforce-memory-cap needs cluster.gpu_memory_gib in {args.config}")
        env[GPU_MEMORY_CAP_ENV] = f"{config.cluster['gpu_memory_gib']:g}"

    run_dir_flags = []
    if "save" not in config.flags:
        run_dir_flags += ["--save", str(run_dir / "checkpoints"), "--load", str(run_dir / "checkpoints")]
        if "save_interval" not in config.flags:  # Megatron requires one with --save; it also saves at the end
            run_dir_flags += ["--save-interval", str(DEFAULT_SAVE_INTERVAL)]
    try:  # the command line the ranks will get, run-dir flags included
        validate_config(config, [*run_dir_flags, *extra], None if args.dry_run else Environment.here())
    except (ConfigError, UnsupportedConfiguration) as err:
        return fail(str(err))
    command = [*torchrun_argv(nnodes, gpus_per_node, run_id, env), str(TRAINER),
               *config.argv(), *run_dir_flags, *extra]

    print(f"launch: {args.config}: {nnodes} node(s) x {gpus_per_node} GPU(s), run dir {run_dir}, node {node}")
    shown = [*RECIPE_ENV, *([GPU_MEMORY_CAP_ENV] if args.enforce_memory_cap else [])]
    print("env: " + " ".join(f"{key}={env[key]}" for key in shown))
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(shlex.join(command) + "\n")
    with open(run_dir / f"train_node{node}.log", "ab") as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
        refusal = None
        for line in process.stdout:  # tee: the terminal and the run's log
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()  # a launcher stopped by SIGTERM keeps no line back from the log
            if refusal is None and line.startswith(b"error: "):  # a training process's refusal (launch.refusal)
                refusal = line.decode(errors="replace")[len("error: "):].strip()
        status = process.wait()
    if status != 0 and refusal is not None:
        # torchrun reports the failed processes after them (a traceback): the sentence goes last.
        return fail(refusal)
    return status

