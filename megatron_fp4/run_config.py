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
installed release. `validate_config` refuses what a launch of the config would refuse.
"""

import argparse
import difflib
import functools
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .console import fail
from .options import (Environment, FP4Options, Route, UnsupportedConfiguration, before_megatron_validation,
                      validate_args)

CLUSTER_KEYS = {"nodes": int, "gpus_per_node": int, "gpu_memory_gib": float}
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


@functools.lru_cache(maxsize=1)
def megatron_parser() -> argparse.ArgumentParser:
    """Megatron's full argument parser plus our flags (building it needs no GPU)."""
    from megatron.training.arguments import add_megatron_arguments

    from .options import add_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
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


def _check_flag(name: str, value, where: Path) -> None:
    flags = known_flags()
    if name not in flags:
        close = difflib.get_close_matches(name, flags, n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"{where}: unknown key {name!r}: not a Megatron flag nor one of ours{hint}")
    if _is_switch(flags[name][1]) and not (value is None or isinstance(value, bool)):
        raise ConfigError(f"{where}: {name} is a switch: give true or false, not {value!r}")


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a mapping of flag names to values, got {type(data).__name__}")
    return data


def _merge_cluster(into: dict, cluster, where: Path) -> None:
    if not isinstance(cluster, dict):
        raise ConfigError(f"{where}: cluster must be a mapping of {sorted(CLUSTER_KEYS)}")
    for key, value in cluster.items():
        if key not in CLUSTER_KEYS:
            raise ConfigError(f"{where}: unknown cluster key {key!r}; known: {', '.join(sorted(CLUSTER_KEYS))}")
        into[key] = CLUSTER_KEYS[key](value)


def load_config(path, _chain: tuple = ()) -> RunConfig:
    """Load `path` with its includes resolved and every key checked."""
    path = Path(path).resolve()
    if path in _chain:
        raise ConfigError(f"include cycle: {' -> '.join(str(p) for p in (*_chain, path))}")
    data = _read_yaml(path)
    config = RunConfig(path=path)
    includes = data.get("include") or []
    for name in [includes] if isinstance(includes, str) else includes:
        base = load_config(path.parent / name, (*_chain, path))
        config.flags.update(base.flags)
        config.cluster.update(base.cluster)
    for key, value in data.items():
        if key == "include":
            continue
        if key == "cluster":
            _merge_cluster(config.cluster, value, path)
            continue
        _check_flag(key, value, path)
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


def parse_config_argv(config: RunConfig) -> argparse.Namespace:
    """Megatron's parser applied to the config's command line (no validation, no GPU)."""
    return megatron_parser().parse_args(config.argv())


def planned_args(config: RunConfig, extra_argv=()) -> argparse.Namespace:
    """The config's command line (then `extra_argv`, which wins; flags Megatron does not know are
    left to the launch to report) parsed, plus the defaults Megatron's validate_args derives from
    other flags, for the settings our refusals read. Megatron's own validation needs the target
    machine (it checks FP8 support on the GPU), so a plan for another machine derives these few."""
    args, _unknown = megatron_parser().parse_known_args([*config.argv(), *extra_argv])
    return before_megatron_validation(args)


def validate_config(config: RunConfig, extra_argv=(), environment: Optional[Environment] = None) -> FP4Options:
    """The validation a launch of `config` (+ `extra_argv`) runs (megatron_fp4.options.validate,
    launcher route). Without `environment`, none of the checks of a machine: the estimator and
    `scripts/launch.py --dry-run` plan for another one; a launch passes this machine's. Raises
    UnsupportedConfiguration (one sentence naming the flag to change)."""
    return validate_args(planned_args(config, extra_argv), Route.LAUNCHER, environment)


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


__all__ = ["ConfigError", "GPU_MEMORY_CAP_ENV", "RunConfig", "flags_to_argv", "known_flags", "load_config",
           "parse_config_argv", "planned_args", "validate_config"]
