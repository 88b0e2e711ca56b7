"""Launch scripts/pretrain_gpt_fp4.py from a YAML run config, on one node or many (torchrun).

    scripts/launch.py configs/proxy/gpus2.yaml [extra launcher flags ...]
    NNODES=32 MASTER_ADDR=node001 scripts/launch.py configs/deepseek_v3_671b/fp4_mla_up_proj.yaml
    scripts/launch.py --dry-run CONFIG       # print the environment and the torchrun command only
    scripts/launch.py --enforce-memory-cap CONFIG   # cap each GPU's memory at cluster.gpu_memory_gib

Nodes and GPUs per node come from the config's `cluster` section; NNODES / GPUS_PER_NODE override
them. One node: `torchrun --standalone`. Several: c10d rendezvous at MASTER_ADDR:MASTER_PORT with
the run's id, the same command on every node (scripts/slurm_launch.sbatch runs it through srun).
The run directory gets the command line, this node's log and the checkpoints: RUN_DIR, else
runs/<config>_<RUN_ID> (SLURM_JOB_ID serves; every node of a job shares it), both the caller's to
name (a directory that holds a checkpoint is resumed from), else a new runs/<config>_<time>, with
_2, _3, ... added when another launch took that name first: two launches never share one. The
launcher adds --save <run dir>/checkpoints and --load of the same unless the config or the extra
flags name save (`save: null`: no checkpoints); a load they name is kept (`load: PATH`, e.g. with
`finetune: true`: the run starts from that checkpoint and saves into its run directory). The first
line says where it loads and saves.
Extra flags go after the config's, so they win. The config and the extra flags are validated as a
launch validates them (megatron_fp4.run_config.validate_config: unknown flags and values, our
refusals, the parallel layouts Megatron asserts on, over NNODES x GPUS_PER_NODE GPUs) before
torchrun starts: a dry run without this machine's checks (it may plan for another one), a launch
with them (a GPU for the --moe-fp4-* flags, Hopper for FP8 experts, the megatron-core release, and
one CUDA GPU per process of this node). A refusal, also one from the training processes, ends the
output with its one sentence and exit status 2, and leaves no run directory behind when torchrun
never started.
torchrun is this interpreter's (`python -m torch.distributed.run`; TORCHRUN replaces it: another
torchrun or a stand-in, so this machine's GPUs are then not counted), so a virtual environment
works without being activated.
With --enforce-memory-cap every training process caps PyTorch's CUDA allocator at the config's
cluster.gpu_memory_gib (passed as MEGATRON_FP4_GPU_MEMORY_CAP_GIB, which the launcher otherwise
clears; scripts/pretrain_gpt_fp4.py applies it before its first CUDA allocation); going past it is
Megatron's usual torch.OutOfMemoryError. Memory outside that allocator (CUDA context, NCCL) is not
capped.
"""

import argparse
import itertools
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..console import fail, quiet_third_party_notices
from ..options import Environment, UnsupportedConfiguration
from ..run_config import (GPU_MEMORY_CAP_ENV, ConfigError, load_config, parse_argv, run_dir_flags,
                          validate_config)

# The checkout this package runs from: run directories and the training entry point live there.
REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "scripts" / "pretrain_gpt_fp4.py"
RUNS = REPO / "runs"  # where run directories go unless RUN_DIR names one

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


def _count(env: dict, name: str, default) -> int:
    """NNODES / GPUS_PER_NODE from the environment, else the config's value."""
    value = env.get(name)
    if value is None:
        return int(default)
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"{name} must be a positive whole number, got {value!r}")
    return int(value)


def _now() -> str:
    return time.strftime("%Y%m%d_%H%M%S")


def _fresh_names(base: Path):
    yield base
    for n in itertools.count(2):
        yield base.with_name(f"{base.name}_{n}")


def plan_run_dir(env: dict, config_path: str):
    """(run directory, None) where the caller names it: RUN_DIR, or RUN_ID / SLURM_JOB_ID, which
    every node of a job turns into the same name (resuming from it is the point). Otherwise (the
    first name of the config and the time that no directory has yet, that name): a dry run shows
    it; a launch takes the first free one as it creates it (make_run_dir)."""
    if env.get("RUN_DIR"):
        return Path(env["RUN_DIR"]).resolve(), None  # absolute: the trainer runs from the repository root
    run_id = env.get("RUN_ID") or env.get("SLURM_JOB_ID")
    stem = Path(config_path).stem
    if run_id:
        return (RUNS / f"{stem}_{run_id}").resolve(), None
    base = (RUNS / f"{stem}_{_now()}").resolve()
    return next(path for path in _fresh_names(base) if not path.exists()), base


def make_run_dir(run_dir: Path, base: Optional[Path]) -> Path:
    """Create the run directory: the caller's (base None) as it is; else the first of base, base_2,
    base_3, ... that this launch creates itself (mkdir is atomic: of two launches in the same
    second, each gets its own)."""
    if base is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    base.parent.mkdir(parents=True, exist_ok=True)
    for path in _fresh_names(base):
        try:
            path.mkdir(exist_ok=False)
            return path
        except FileExistsError:
            continue


def gpus_missing(gpus_per_node: int) -> Optional[str]:
    """The refusal of a launch whose node has fewer CUDA GPUs than it starts processes, or None.
    Megatron's training needs one per process (without, each process ends in an AssertionError
    after its argument dump)."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found >= gpus_per_node:
        return None
    if not found:
        return (f"this launch trains on CUDA GPUs ({gpus_per_node} process(es) on this node, one per GPU) and torch "
                "finds none on this machine: run it where the GPUs are (--dry-run prints its command here).")
    return (f"this launch starts {gpus_per_node} training processes on this node, one per CUDA GPU, and torch finds "
            f"{found} on this machine: run it on a node with {gpus_per_node}, or choose a config for {found}.")


def checkpoints_note(argv: list) -> str:
    """Where the run loads from and saves to, read from its command line."""
    args = parse_argv(argv, "the launch's command line")
    if args.save is None and args.load is None:
        return "no checkpoints"
    if args.save == args.load:
        return f"checkpoints saved to and resumed from {args.save}"
    return f"loads {args.load or 'no checkpoint'}, saves {args.save or 'no checkpoints'}"


def main(argv=None) -> int:
    quiet_third_party_notices()  # before the config's flags are checked against Megatron's parser
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        return fail(str(err))
    env = {**RECIPE_ENV, **os.environ}
    env.update({key: RECIPE_ENV[key] for key in FORCED_ENV})
    try:
        nnodes = _count(env, "NNODES", config.cluster.get("nodes", 1))
        gpus_per_node = _count(env, "GPUS_PER_NODE", config.cluster.get("gpus_per_node", 1))
    except ConfigError as err:
        return fail(str(err))
    if nnodes > 1 and (missing := missing_multi_node_variables(env)):  # every node must name the same rendezvous
        return fail(f"a multi-node launch ({nnodes} nodes) needs {' and '.join(missing)}, set on every node.")
    run_id = env.get("RUN_ID") or env.get("SLURM_JOB_ID") or _now()
    run_dir, fresh_base = plan_run_dir(env, args.config)
    node = env.get("NODE_RANK", env.get("SLURM_NODEID", "0"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(GPU_MEMORY_CAP_ENV, None)  # the flag alone decides, not a variable left in the caller's shell
    if args.enforce_memory_cap:
        if "gpu_memory_gib" not in config.cluster:
            return fail(f"--enforce-memory-cap needs cluster.gpu_memory_gib in {args.config}")
        env[GPU_MEMORY_CAP_ENV] = f"{config.cluster['gpu_memory_gib']:g}"

    try:  # the command line the ranks will get, run-dir flags included, on the GPUs this launch starts
        validate_config(config, extra, None if args.dry_run else Environment.here(),
                        world_size=nnodes * gpus_per_node, run_dir=run_dir)
    except (ConfigError, UnsupportedConfiguration) as err:
        return fail(str(err))
    if not args.dry_run and not os.environ.get("TORCHRUN") and (refusal := gpus_missing(gpus_per_node)):
        return fail(refusal)
    if not args.dry_run:
        run_dir = make_run_dir(run_dir, fresh_base)
    added = run_dir_flags(config, extra, run_dir)
    command = [*torchrun_argv(nnodes, gpus_per_node, run_id, env), str(TRAINER), *config.argv(), *added, *extra]

    print(f"launch: {args.config}: {nnodes} node(s) x {gpus_per_node} GPU(s), run dir {run_dir}, node {node}; "
          f"{checkpoints_note([*config.argv(), *added, *extra])}")
    shown = [*RECIPE_ENV, *([GPU_MEMORY_CAP_ENV] if args.enforce_memory_cap else [])]
    print("env: " + " ".join(f"{key}={env[key]}" for key in shown))
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
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

