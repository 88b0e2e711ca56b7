"""YAML run configs: Megatron's own flag names (dashes as underscores) plus ours, turned into the
command line of our launcher (megatron_fp4.launch), checked the way a launch checks it.

A config file holds:
- `include`: a file name or list of them, relative to this file, loaded first (later files and
  this file's own keys override them);
- `cluster`: where it runs, for the launch scripts and the estimator (`nodes`, `gpus_per_node`,
  `gpu_memory_gib`); not a Megatron flag (`scripts/launch.py --enforce-memory-cap` turns
  `gpu_memory_gib` into a per-process CUDA memory cap);
- every other key: a flag. `true` writes the flag, `false` or `null` leaves it out (so an include's
  switch can be turned off), a list writes its items after the flag, anything else one value.

Unknown keys are an error that names the close matches; the flag names come from Megatron's parser
(megatron.training.arguments) plus ours (`megatron_fp4.options.add_arguments`), so they follow the
installed release. So are a value the flag does not take (`micro_batch_size: four`, as Megatron's
parser would read it), a key written twice in one file, and a malformed `include` or `cluster`: one
line naming the file and the key.

`validate_config` refuses what a launch of the config would refuse, for every route that plans or
starts one (`scripts/launch.py` with and without --dry-run, `megatron-fp4 estimate` and `argv`): the
extra flags (unknown ones named, with close matches), the checkpoint flags the launcher adds
(`run_dir_flags`), our refusal table (megatron_fp4.options) and the parallel layouts Megatron's own
start-up asserts on (`check_layout`: experts over expert parallelism, the groups' sizes against the
launch's GPUs, the batch sizes against data parallelism).
"""

import argparse
import difflib
import functools
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .console import fail
from .options import (Environment, FP4Options, Route, UnsupportedConfiguration, before_megatron_validation,
                      validate_args)

CLUSTER_KEYS = {"nodes": int, "gpus_per_node": int, "gpu_memory_gib": float}
# scripts/launch.py: Megatron requires --save-interval with --save; it also saves at the end.
DEFAULT_SAVE_INTERVAL = 1000
# The run directory a plan validates with when it has none yet (the path changes no refusal).
PLANNED_RUN_DIR = Path("runs") / "RUN"
# How scripts/launch.py --enforce-memory-cap hands cluster.gpu_memory_gib to each training process.
GPU_MEMORY_CAP_ENV = "MEGATRON_FP4_GPU_MEMORY_CAP_GIB"
RESERVED_KEYS = ("include", "cluster")


class ConfigError(ValueError):
    """A config file that cannot stand for a command line."""


@dataclass
class RunConfig:
    path: Path
    flags: dict = field(default_factory=dict)  # flag name with underscores -> value, in file order
    cluster: dict = field(default_factory=dict)

    def argv(self) -> list:
        return flags_to_argv(self.flags)

    def world_size(self) -> int:
        return int(self.cluster.get("nodes", 1)) * int(self.cluster.get("gpus_per_node", 1))


class _Parser(argparse.ArgumentParser):
    """A parser that raises instead of printing its usage (hundreds of lines for Megatron's) and
    exiting: the caller turns the error into one line."""

    def error(self, message):
        raise ConfigError(message)


@functools.lru_cache(maxsize=1)
def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's full argument parser plus our flags (building it needs no GPU). Like Megatron's,
    it takes no abbreviations; unlike it, a wrong value raises argparse.ArgumentError and anything
    else it would print its usage for raises ConfigError."""
    from megatron.training.arguments import add_megatron_arguments

    from .options import add_arguments

    parser = _Parser(allow_abbrev=False, add_help=False, exit_on_error=False)
    return add_arguments(add_megatron_arguments(parser))


@functools.lru_cache(maxsize=1)
def known_flags() -> dict:
    """Flag name with underscores -> (its option string, its argparse action), for every --long
    option. The option string is kept because a few of Megatron's own contain underscores."""
    flags = {}
    for action in megatron_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option[2:].replace("-", "_")] = (option, action)
    return flags


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _close_matches(name: str, candidates, n: int = 4) -> str:
    close = difflib.get_close_matches(name, candidates, n=n, cutoff=0.6)
    return f"; did you mean {', '.join(close)}?" if close else ""


def check_flag(name: str, value, where: Path) -> None:
    flags = known_flags()
    if name not in flags:
        raise ConfigError(f"{where}: unknown key {name!r}: not a Megatron flag nor one of ours"
                          f"{_close_matches(name, flags)}")
    option, action = flags[name]
    if _is_switch(action):
        if not (value is None or isinstance(value, bool)):
            raise ConfigError(f"{where}: {name} is a switch: give true or false, not {value!r}")
        return
    if value is None or value is False:  # left out
        return
    if value is True:
        if action.nargs == "?":  # the flag alone takes its const
            return
        raise ConfigError(f"{where}: {name} takes a value ({option} {action.metavar or action.dest.upper()}), "
                          "not true")
    many = isinstance(value, (list, tuple))
    items = [str(item) for item in (value if many else [value])]
    if action.nargs in (None, "?") and many:
        raise ConfigError(f"{where}: {name} takes one value, not a list ({value!r})")
    if (isinstance(action.nargs, int) and len(items) != action.nargs) or (action.nargs == "+" and not items):
        wanted = "at least one value" if action.nargs == "+" else f"{action.nargs} value(s)"
        raise ConfigError(f"{where}: {name} takes {wanted}, got {value!r}")
    try:  # the conversion and choices of Megatron's parser, as the launch's parser applies them
        megatron_parser()._get_values(action, items if action.nargs not in (None, "?") else items[:1])
    except argparse.ArgumentError as err:
        raise ConfigError(f"{where}: {name}: {err.message}") from None


class _DuplicateKey(yaml.YAMLError):
    pass


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _value in node.value:
            key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
            try:
                if key in seen and key != "<<":
                    raise _DuplicateKey(f"key {key!r} is written twice (lines {seen[key]} and {line}): keep one")
                seen[key] = line
            except TypeError:  # an unhashable key: construct_mapping reports it
                continue
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_ConfigLoader)  # noqa: S506 (a safe loader)
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of flag names to values, got {type(data).__name__}")
    return data


def _cluster_value(key: str, value, where: Path):
    kind = CLUSTER_KEYS[key]
    wanted = "a positive whole number" if kind is int else "a positive number"
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0 and (kind is float or number.is_integer())):
        raise ConfigError(f"{where}: cluster.{key} must be {wanted}, got {value!r}")
    return kind(number)


def _merge_cluster(into: dict, cluster, where: Path) -> None:
    if not isinstance(cluster, dict):
        raise ConfigError(f"{where}: cluster must be a mapping of {sorted(CLUSTER_KEYS)}")
    for key, value in cluster.items():
        if key not in CLUSTER_KEYS:
            raise ConfigError(f"{where}: unknown cluster key {key!r}; known: {', '.join(sorted(CLUSTER_KEYS))}")
        into[key] = _cluster_value(key, value, where)


def _includes(value, where: Path) -> list:
    if value is None:
        return []
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ConfigError(f"{where}: include takes a file name or a list of them, got {value!r}")
    return names


def load_config(path, _chain: tuple = ()) -> RunConfig:
    """Load `path` with its includes resolved and every key checked."""
    path = Path(path).resolve()
    if path in _chain:
        raise ConfigError(f"include cycle: {' -> '.join(str(p) for p in (*_chain, path))}")
    data = _read_yaml(path)
    config = RunConfig(path=path)
    for name in _includes(data.get("include"), path):
        base = load_config(path.parent / name, (*_chain, path))
        config.flags.update(base.flags)
        config.cluster.update(base.cluster)
    for key, value in data.items():
        if key == "include":
            continue
        if key == "cluster":
            _merge_cluster(config.cluster, value, path)
            continue
        check_flag(key, value, path)
        config.flags.pop(key, None)  # an override moves to the end, as it would on a command line
        config.flags[key] = value
    return config


def flags_to_argv(flags: dict) -> list:
    argv = []
    for name, value in flags.items():
        option = known_flags()[name][0]
        if value is None or value is False:
            continue
        if value is True:
            argv.append(option)
        elif isinstance(value, (list, tuple)):
            argv += [option, *(str(item) for item in value)]
        else:
            argv += [option, str(value)]
    return argv


def _unknown_word(word: str, where: str) -> str:
    if word.startswith("-"):
        flag = word.split("=", 1)[0]
        options = [option for option, _action in known_flags().values()]
        return f"{where}: unknown flag {flag}: not a Megatron flag nor one of ours{_close_matches(flag, options, n=2)}"
    return f"{where}: unexpected argument {word!r} (a value without its flag, or a flag that takes none?)"


def parse_argv(argv, where: str) -> argparse.Namespace:
    """Megatron's parser (plus our flags) applied to `argv` as a training process's parser reads
    it, without validation and without a GPU; anything it would stop on (a flag it does not know,
    a value the flag does not take) is a ConfigError of one line that starts with `where`."""
    try:
        args, unknown = megatron_parser().parse_known_args(list(argv))
    except argparse.ArgumentError as err:
        raise ConfigError(f"{where}: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if unknown:
        raise ConfigError(_unknown_word(unknown[0], where))
    return args


def parse_config_argv(config: RunConfig) -> argparse.Namespace:
    """Megatron's parser applied to the config's command line (no validation, no GPU)."""
    return parse_argv(config.argv(), str(config.path))


def check_extra_argv(extra_argv) -> None:
    """Flags given after a config (scripts/launch.py CONFIG --flag ...): each one a flag of
    Megatron's or ours with a value it takes, or a ConfigError naming the first that is not (and
    the flags it may have meant)."""
    parse_argv(extra_argv, "extra flags")


def _named(name: str, config: RunConfig, extra_argv) -> bool:
    """Whether the config has key `name` (null included) or the extra flags give its flag."""
    options = known_flags()[name][1].option_strings
    return name in config.flags or any(word.split("=", 1)[0] in options for word in extra_argv)


def run_dir_flags(config: RunConfig, extra_argv, run_dir) -> list:
    """The checkpoint flags our launcher adds to a run's command line (before the extra flags).
    Unless the config or the extra flags name save (`save: null`: no checkpoints), it saves into
    `run_dir`/checkpoints every DEFAULT_SAVE_INTERVAL iterations (unless they name save_interval)
    and, unless they name load, loads from there: a relaunch into the same run directory resumes.
    A load the config or the extra flags name is theirs and stays (e.g. `load: PATH` with
    `finetune: true`): the run starts from it and saves into its run directory."""
    extra_argv = list(extra_argv)
    if _named("save", config, extra_argv):
        return []
    checkpoints = str(Path(run_dir) / "checkpoints")
    flags = ["--save", checkpoints]
    if not _named("save_interval", config, extra_argv):
        flags += ["--save-interval", str(DEFAULT_SAVE_INTERVAL)]
    if not _named("load", config, extra_argv):
        flags += ["--load", checkpoints]
    return flags


def planned_args(config: RunConfig, extra_argv=()) -> argparse.Namespace:
    """The config's command line (then `extra_argv`, which wins) parsed, plus the defaults
    Megatron's validate_args derives from other flags, for the settings our refusals read.
    Megatron's own validation needs the target machine (it checks FP8 support on the GPU), so a
    plan for another machine derives these few. A flag Megatron does not know, or a value it does
    not take, is a ConfigError."""
    extra_argv = list(extra_argv)
    check_extra_argv(extra_argv)
    return before_megatron_validation(parse_argv([*config.argv(), *extra_argv], str(config.path)))


def _refuse(sentence: str):
    raise UnsupportedConfiguration(sentence)


def check_layout(args, world_size: int) -> None:
    """What Megatron's start-up asserts on about the parallel layout of `world_size` GPUs
    (megatron.training.arguments.validate_args, initialize_model_parallel, the micro-batch
    calculator), refused in one sentence before any process starts."""
    tp, pp = args.tensor_model_parallel_size or 1, args.pipeline_model_parallel_size or 1
    cp, ep = args.context_parallel_size or 1, args.expert_model_parallel_size or 1
    etp = args.expert_tensor_parallel_size or tp
    gpus = f"{world_size} GPU(s) (nodes x gpus_per_node)"
    if world_size % (tp * pp * cp):
        _refuse(f"the launch's {gpus} do not split into tensor x pipeline x context parallel groups of "
                f"{tp} x {pp} x {cp}: change those sizes or the GPU count.")
    if ep > 1 and not args.num_experts:
        _refuse(f"--expert-model-parallel-size {ep} needs an MoE model: set --num-experts or use expert "
                "parallelism 1.")
    if args.num_experts and args.num_experts % ep:
        _refuse(f"{args.num_experts} experts do not split over expert parallelism {ep}: --num-experts must be a "
                "multiple of --expert-model-parallel-size.")
    if world_size % (etp * ep * pp):
        _refuse(f"the launch's {gpus} do not split into expert-tensor x expert x pipeline parallel groups of "
                f"{etp} x {ep} x {pp}: change --expert-model-parallel-size (or --expert-tensor-parallel-size) "
                "or the GPU count.")
    dp = world_size // (tp * pp * cp)
    micro, batch = args.micro_batch_size, args.global_batch_size
    if micro and batch and not getattr(args, "rampup_batch_size", None) and batch % (micro * dp):
        _refuse(f"--global-batch-size {batch} is not a multiple of --micro-batch-size {micro} x data parallelism "
                f"{dp} (the {world_size} GPU(s) over TP x PP x CP): change the batch sizes.")
    eval_micro = getattr(args, "eval_micro_batch_size", None) or micro
    eval_batch = getattr(args, "eval_global_batch_size", None) or batch
    if eval_micro and eval_batch and eval_batch % (eval_micro * dp):
        _refuse(f"--eval-global-batch-size {eval_batch} is not a multiple of --eval-micro-batch-size {eval_micro} x "
                f"data parallelism {dp} (the {world_size} GPU(s) over TP x PP x CP): change the evaluation batch "
                "sizes.")


def validate_config(config: RunConfig, extra_argv=(), environment: Optional[Environment] = None,
                    world_size: Optional[int] = None, run_dir=None) -> FP4Options:
    """The validation a launch of `config` (+ `extra_argv`) runs, the one every route calls
    (scripts/launch.py with and without --dry-run, `megatron-fp4 estimate` and `argv`): the extra
    flags, the launcher's checkpoint flags for `run_dir` (a plan's stand-in when None), our refusal
    table (megatron_fp4.options.validate, launcher route) and the layout on `world_size` GPUs (the
    config's cluster section when None). Without `environment`, none of the checks of a machine: the
    estimator and `scripts/launch.py --dry-run` plan for another one; a launch passes this machine's.
    Raises ConfigError or UnsupportedConfiguration (one sentence naming the flag to change)."""
    extra_argv = list(extra_argv)
    added = run_dir_flags(config, extra_argv, PLANNED_RUN_DIR if run_dir is None else run_dir)
    args = planned_args(config, [*added, *extra_argv])
    options = validate_args(args, Route.LAUNCHER, environment)
    check_layout(args, config.world_size() if world_size is None else world_size)
    return options


def register(subparsers) -> None:
    parser = subparsers.add_parser("argv", help="print the Megatron command line a YAML config stands for")
    parser.add_argument("config", help="YAML run config")
    parser.set_defaults(run=_run_argv)


def _run_argv(args) -> int:
    try:
        config = load_config(args.config)
        validate_config(config)
    except (ConfigError, UnsupportedConfiguration) as err:
        return fail(str(err))
    print(shlex.join(config.argv()))
    return 0


__all__ = ["ConfigError", "DEFAULT_SAVE_INTERVAL", "GPU_MEMORY_CAP_ENV", "RunConfig", "check_extra_argv",
           "check_layout", "flags_to_argv", "known_flags", "load_config", "parse_argv", "parse_config_argv",
           "planned_args", "run_dir_flags", "validate_config"]
