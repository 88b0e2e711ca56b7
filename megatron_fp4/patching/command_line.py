"""`megatron-fp4 patch`: patch a Megatron-LM (or megatron-core source) tree so that its own
training script offers --moe-fp4-dispatch and its MoE layers use our dispatcher; for people who keep
a Megatron-LM fork. (The plugin route, `megatron_fp4.integration.use_fp4_dispatch`, needs no patch.)

    megatron-fp4 patch check PATH     # would the patch apply? (nothing is written)
    megatron-fp4 patch apply PATH     # apply it (all or nothing); "already applied" is not an error
    megatron-fp4 patch revert PATH    # take it out again
    megatron-fp4 patch list           # the patch sets and where their files are (for git apply)

The tree's version is read from megatron/core/package_info.py; the patch set of its release line
(megatron_fp4/patching/patches/core_r0.MINOR/) is used. Each set has two parts, each a unified diff that `git apply` and
`patch -p1` also accept: core.patch (megatron/core) and training.patch (megatron/training); the
training part is skipped for trees without megatron/training (a checkout of megatron/core
alone). Patches are checked and applied in pure Python (megatron_fp4.patching.unified_diff),
strictly: no fuzz, any offset. Exit status: 0 done (or nothing to do), 1 conflict (nothing was
written), 2 cannot proceed (not a Megatron tree, unsupported release, missing patch files).
"""

import argparse
import sys
from typing import Optional, Sequence

from .actions import list_patch_sets, run_patch


def _run(args) -> int:
    if args.patch_action == "list":
        return list_patch_sets()
    return run_patch(args.patch_action, args.path, args.line)


def register(subparsers) -> argparse.ArgumentParser:
    """Add `patch` to the `megatron-fp4` command (megatron_fp4.cli)."""
    parser = subparsers.add_parser(
        "patch", help="patch a Megatron-LM tree to offer --moe-fp4-dispatch (check, apply, revert, list)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="patch_action", required=True, metavar="{check,apply,revert,list}")
    for action, text in (("check", "would the patch apply? nothing is written"),
                         ("apply", "apply the patch (all parts or nothing)"),
                         ("revert", "take the patch out again")):
        sub = actions.add_parser(action, help=text, description=text)
        sub.add_argument("path", metavar="PATH", help="root of the Megatron-LM or megatron-core tree (holds megatron/)")
        sub.add_argument("--line", metavar="LINE", default=None,
                         help="use this release line's patch set (e.g. core_r0.19 or 0.19) instead of the one of the "
                              "tree's version (itself one of the supported lines)")
    actions.add_parser("list", help="the patch sets and their files", description="the patch sets and their files")
    parser.set_defaults(run=_run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`megatron-fp4 patch ...` alone: main(["check", PATH])."""
    parser = argparse.ArgumentParser(prog="megatron-fp4")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["patch", *(sys.argv[1:] if argv is None else argv)])
    return args.run(args)
