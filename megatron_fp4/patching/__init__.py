"""`megatron-fp4 patch`: patch a Megatron-LM (or megatron-core source) tree so that its own
training script offers --moe-fp4-dispatch and its MoE layers use our dispatcher (the command and
its help: command_line). The modules, one job each: megatron_tree (a tree's root and release),
release_lines (which patch set serves it), patch_sets (the patch files, checked against a tree),
unified_diff (the diffs, parsed and applied in pure Python), report (what the command prints),
actions (check, apply, revert, list).
"""

from .actions import list_patch_sets, run_patch
from .command_line import main, register
from .errors import PatchError
from .megatron_tree import MegatronVersion, detect_version, find_tree_root, read_version
from .patch_sets import PATCH_DIR, check_part, load_parts
from .release_lines import RELEASE_LINES, ReleaseLine, release_line_for, release_line_named

__all__ = [
    "MegatronVersion",
    "PATCH_DIR",
    "PatchError",
    "RELEASE_LINES",
    "ReleaseLine",
    "check_part",
    "detect_version",
    "find_tree_root",
    "list_patch_sets",
    "load_parts",
    "main",
    "read_version",
    "register",
    "release_line_for",
    "release_line_named",
    "run_patch",
]
