"""The `megatron-fp4` command: one subcommand per job, each registered by the module that does it.

    megatron-fp4 estimate CONFIG.yaml     # per-GPU memory and all-to-all bytes (megatron_fp4.estimator)
    megatron-fp4 patch check|apply PATH   # patch a Megatron-LM tree (megatron_fp4.patching)
    megatron-fp4 argv CONFIG.yaml         # the Megatron command line a YAML config stands for
    megatron-fp4 corpus PREFIX            # a byte-level indexed dataset from local text (megatron_fp4.corpus)

estimate and argv refuse, in one sentence with exit status 2, a config that a launch would refuse.
"""

import argparse
import importlib
import sys

from .console import quiet_third_party_notices

# Subcommand modules; each has register(subparsers) that adds its parser with set_defaults(run=...).
SUBCOMMAND_MODULES = ("megatron_fp4.estimator", "megatron_fp4.patching", "megatron_fp4.run_config",
                      "megatron_fp4.corpus")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-fp4", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        module.register(subparsers)
    return parser


def main(argv=None) -> int:
    quiet_third_party_notices()  # before the subcommands import Megatron
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
