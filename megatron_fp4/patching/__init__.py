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
import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, TextIO, Tuple

from .unified_diff import APPLIED, APPLIES, CONFLICT, FilePatch, FileResult, PatchFormatError, check_file, parse

PATCH_DIR = Path(__file__).resolve().parent / "patches"
PART_FILES = (("core", "core.patch"), ("training", "training.patch"))


class PatchError(Exception):
    """Why the command cannot proceed (exit status 2): one or two plain sentences."""


@dataclass(frozen=True)
class MegatronVersion:
    major: int
    minor: int
    patch: int
    pre_release: str = ""

    @property
    def line(self) -> Tuple[int, int]:
        return self.major, self.minor

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}{self.pre_release}"


@dataclass(frozen=True)
class ReleaseLine:
    name: str  # the patch set's folder, after Megatron-LM's release branches core_r0.MINOR.x
    version: Tuple[int, int]
    made_against: str  # the megatron-core release whose files the diffs were made from


# One patch set per release line the plugin supports (megatron_fp4.options.SUPPORTED_MEGATRON_CORE,
# whose every line tests/versions runs; tests/patching/test_patching.py checks the two agree).
RELEASE_LINES = (
    ReleaseLine("core_r0.18", (0, 18), "0.18.2"),
    ReleaseLine("core_r0.19", (0, 19), "0.19.2"),
)


def supported_lines_text() -> str:
    return ", ".join(f"{line.name} ({line.version[0]}.{line.version[1]}.x)" for line in RELEASE_LINES)


# ----------------------------------------------------------------------------------------------------
# The tree and its version


def find_tree_root(path) -> Path:
    """`path` itself when it holds megatron/core/package_info.py; else PatchError saying what to pass."""
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        raise PatchError(f"{root} is not a folder.")
    if (root / "megatron" / "core" / "package_info.py").is_file():
        return root
    for parent, inside in ((root.parent, "core/package_info.py"), (root.parent.parent, "package_info.py")):
        if (root / inside).is_file() and (parent / "megatron" / "core" / "package_info.py").is_file():
            raise PatchError(f"{root} is inside a Megatron tree: give its root, {parent} (the folder that holds "
                             "megatron/).")
    raise PatchError(
        f"{root} is not a Megatron-LM or megatron-core source tree: {root / 'megatron/core/package_info.py'} "
        "does not exist."
    )


def read_version(package_info: Path) -> MegatronVersion:
    """MAJOR, MINOR, PATCH (and PRE_RELEASE) as assigned in megatron/core/package_info.py, read
    without importing it."""
    try:
        tree = ast.parse(Path(package_info).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as error:
        raise PatchError(f"cannot read the megatron-core version from {package_info}: {error}")
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant):
                values[node.targets[0].id] = node.value.value
    numbers = [values.get(key) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
        raise PatchError(f"cannot read the megatron-core version from {package_info}: it does not set MAJOR, MINOR "
                         "and PATCH to integers.")
    pre = values.get("PRE_RELEASE", "")
    return MegatronVersion(*numbers, pre if isinstance(pre, str) else "")


def detect_version(path) -> MegatronVersion:
    return read_version(find_tree_root(path) / "megatron" / "core" / "package_info.py")


def release_line_for(version: MegatronVersion) -> ReleaseLine:
    for line in RELEASE_LINES:
        if line.version == version.line:
            return line
    raise PatchError(f"megatron-core {version} (release line core_r{version.major}.{version.minor}) has no patch "
                     f"here. {_supported_release_advice(version)}")


def _supported_release_advice(version: MegatronVersion) -> str:
    """What works for a tree outside the supported lines: megatron_fp4 refuses its release on every
    route (megatron_fp4.options), so neither the plugin route nor another line's patch set (--line)
    would run on it; only another release of the tree does."""
    releases = " or ".join(f"{major}.{minor}" for major, minor in (line.version for line in RELEASE_LINES))
    move = "upgrade" if version.line < RELEASE_LINES[0].version else "move"
    return (f"Supported release lines: {supported_lines_text()}, and megatron_fp4 refuses any other release on "
            f"every route (patch, plugin, launcher): {move} this tree to Megatron-LM / megatron-core {releases}, "
            "then run the command again.")


def release_line_named(name: str) -> ReleaseLine:
    wanted = name if name.startswith("core_r") else f"core_r{name}"
    wanted = wanted[:-2] if wanted.endswith(".x") else wanted
    for line in RELEASE_LINES:
        if line.name == wanted:
            return line
    raise PatchError(f"no patch set {name!r}. Supported release lines: {supported_lines_text()}.")


# ----------------------------------------------------------------------------------------------------
# Patch sets


@dataclass
class Part:
    name: str  # "core" or "training"
    path: Path  # the patch file
    files: List[FilePatch]


def load_parts(line: ReleaseLine) -> List[Part]:
    folder = PATCH_DIR / line.name
    if not folder.is_dir():
        raise PatchError(
            f"the patch files of {line.name} are missing ({folder} does not exist): this megatron_fp4 "
            "installation lacks its package data; reinstall it (pip install -e . from a checkout)."
        )
    parts = []
    for name, filename in PART_FILES:
        path = folder / filename
        if path.is_file():
            try:
                parts.append(Part(name, path, parse(path.read_text(encoding="utf-8"), source=str(path))))
            except PatchFormatError as error:
                raise PatchError(f"a patch file of megatron_fp4 is broken: {error}")
    return parts


def _part_is_absent(part: Part, root: Path) -> bool:
    """The training part goes to trees that have megatron/training (Megatron-LM, the megatron-core
    sdists of the supported lines); a checkout of megatron/core alone has none."""
    return part.name == "training" and not (root / "megatron" / "training").is_dir()


@dataclass
class PartResult:
    part: Part
    status: str  # APPLIES, APPLIED, CONFLICT (also for partly applied or missing files) or "absent"
    files: List[FileResult]


def check_part(part: Part, root: Path, reverse: bool = False) -> PartResult:
    if _part_is_absent(part, root):
        return PartResult(part, "absent", [])
    files = [check_file(root, fp.reversed() if reverse else fp) for fp in part.files]
    statuses = {f.status for f in files}
    if statuses == {APPLIES}:
        status = APPLIES
    elif statuses == {APPLIED}:
        status = APPLIED
    else:
        status = CONFLICT
    return PartResult(part, status, files)


# ----------------------------------------------------------------------------------------------------
# Reports in plain words


def _git_has_local_changes(root: Path, relative: str) -> Optional[bool]:
    """True/False when `root` is in a git work tree; None when that cannot be told."""
    if shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", relative],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return bool(done.stdout.strip())


def _show(text: Optional[str]) -> str:
    return "(end of file)" if text is None else (text if text.strip() else "(blank line)")


@dataclass
class _Report:
    """What a report needs to know besides the results: where, which patch set, which direction."""

    root: Path
    line: ReleaseLine
    version: MegatronVersion
    forced: bool  # the patch set was chosen with --line
    reverse: bool  # revert
    out: TextIO

    def say(self, text: str) -> None:
        print(text, file=self.out)

    def likely_reason(self, file: FileResult) -> str:
        if any(h.status == APPLIED for h in file.hunks):
            if self.reverse:
                return ("part of this change is not in the file (never applied there, or already taken out) and "
                        "the rest does not match it either: the file was patched partly or changed since.")
            return ("part of this change is already in the file and part is not: the file was patched partly "
                    "(an interrupted apply, or a hand edit) or has been changed since it was patched.")
        if _git_has_local_changes(self.root, file.patch.path):
            return "git shows local changes in this file: they likely touch the lines the patch needs."
        if self.forced and self.version.line != self.line.version:
            return (f"this tree is megatron-core {self.version} and you chose the {self.line.name} patch set "
                    "(--line): the lines differ between these releases.")
        if str(self.version) != self.line.made_against:
            return (f"this tree is megatron-core {self.version} and the patch was made against "
                    f"{self.line.made_against}: the lines may differ between these releases, or the file was "
                    "modified locally.")
        return (f"the file is not as in megatron-core {self.line.made_against}: it was modified locally (a fork's "
                "own change or a hand edit), or the tree is not the release its package_info.py names.")

    def file_conflict(self, file: FileResult, part: Part) -> None:
        path = file.patch.path
        if file.status == "missing":
            self.say(f"  CONFLICT: {path} does not exist in this tree, but the {part.name} part changes it. Likely "
                     f"reason: this tree is laid out differently from megatron-core {self.line.made_against}.")
            return
        done, todo = ("is not in the file", "can be taken out") if self.reverse else (
            "is already in the file", "would apply")
        total = len(file.hunks)
        for result in file.hunks:
            hunk = result.hunk
            if result.status != CONFLICT:
                state = done if result.status == APPLIED else todo
                self.say(f"  {path}: hunk {hunk.number} of {total} {state} (line {result.line}).")
                continue
            m = result.mismatch
            expects = "the patched lines" if self.reverse else "these lines"
            self.say(f"  CONFLICT in {path}, hunk {hunk.number} of {total} [{hunk.header}]:")
            if 2 * m.agree >= m.total:
                self.say(f"    the patch expects {m.total} lines near line {hunk.old_start}; the closest place in "
                         f"your file is line {m.line}, where {m.agree} of them agree. There:")
                for number, expected, found in m.differences[:3]:
                    self.say(f"      line {number}: expected  {_show(expected)}")
                    self.say(f"      {' ' * len(str(number))}       found     {_show(found)}")
                if len(m.differences) > 3:
                    self.say(f"      ... and {len(m.differences) - 3} more lines differ.")
            else:
                self.say(f"    the patch expects {expects} near line {hunk.old_start}, and no place in your file has "
                         f"most of them (at best {m.agree} of {m.total}, at line {m.line}). They begin:")
                for text in [t for t in hunk.old if t.strip()][:3]:
                    self.say(f"      {text}")
        self.say(f"    Likely reason: {self.likely_reason(file)}")

    def part_conflict(self, result: PartResult) -> None:
        patched, unpatched = ("not patched", "patched") if self.reverse else ("patched", "not patched")
        for file in result.files:
            if file.status == APPLIED:
                self.say(f"  {file.patch.path}: already {patched}.")
            elif file.status == APPLIES:
                self.say(f"  {file.patch.path}: {unpatched}, and the patch fits it.")
            else:
                self.file_conflict(file, result.part)
        if all(f.status in (APPLIES, APPLIED) for f in result.files):
            self.say(f"    Likely reason: the {result.part.name} part was applied to some of its files only (an "
                     "interrupted apply, or a hand edit).")

    def summary(self, result: PartResult) -> str:
        names = ", ".join(f.patch.path for f in result.files)
        if result.status == "absent":
            return ("skipped: this tree has no megatron/training (only megatron/core); apply the patch to the "
                    "Megatron-LM checkout that has it")
        if result.status == CONFLICT:
            return "CONFLICT"
        if self.reverse:
            return f"applied, can be reverted ({names})" if result.status == APPLIES else f"not applied ({names})"
        if result.status == APPLIED:
            return f"already applied ({names})"
        hunks = sum(len(f.hunks) for f in result.files)
        moved = sum(1 for f in result.files for h in f.hunks if h.offset)
        elsewhere = f"; {moved} at other line numbers than the patch names" if moved else ""
        return f"applies cleanly ({hunks} hunks in {names}{elsewhere})"


# ----------------------------------------------------------------------------------------------------
# check / apply / revert


def run_patch(action: str, path, line_name: Optional[str] = None, out: TextIO = None, err: TextIO = None) -> int:
    """`megatron-fp4 patch ACTION PATH` (ACTION: check, apply or revert): print the report, return the
    exit status (0 done or nothing to do, 1 conflict, 2 cannot proceed)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        root = find_tree_root(path)
        version = detect_version(root)
        line = release_line_for(version)  # refuses a release outside the supported lines, --line or not
        if line_name:
            line = release_line_named(line_name)
        parts = load_parts(line)
    except PatchError as error:
        print(f"error: {error}", file=err)
        return 2
    report = _Report(root, line, version, forced=line_name is not None, reverse=action == "revert", out=out)
    chosen = f"the {line.name} patch set" + (" (--line)" if report.forced else "")
    report.say(f"Megatron tree {root}: megatron-core {version}; using {chosen}, made against {line.made_against}.")

    # Forward: APPLIES = not applied yet, APPLIED = in the tree. Reverse: the other way round.
    results = [check_part(part, root, reverse=report.reverse) for part in parts]
    for result in results:
        report.say(f"  {result.part.name} part ({result.part.path.name}): {report.summary(result)}")
        if result.status == CONFLICT:
            report.part_conflict(result)

    folder = PATCH_DIR / line.name
    if any(r.status == CONFLICT for r in results):
        if report.reverse:
            report.say("Nothing was changed: the patch cannot be reverted cleanly. Take it out by hand (the lines "
                       f"starting with + in the patch files in {folder} are what it added), then run the command "
                       "again.")
        else:
            report.say("Nothing was changed: the patch cannot be applied cleanly. Make the change by hand (in the "
                       f"hunks named above, in the patch files in {folder}, lines starting with + are added and - "
                       "removed), or fix the file, then run the command again.")
        return 1

    todo = [r for r in results if r.status == APPLIES]
    if not todo:
        if report.reverse:
            report.say("Not applied: the patch is not in this tree; nothing to revert.")
        elif any(r.status == APPLIED for r in results):
            report.say("Already applied: the patch is in this tree; nothing to do.")
        else:
            report.say("Nothing to do: no part of the patch set concerns this tree.")
        return 0

    changed = [f for r in todo for f in r.files]
    if action == "check":
        report.say(f"Check passed: `megatron-fp4 patch apply {root}` would change {len(changed)} files.")
        return 0
    for file in changed:  # every part was checked first: all or nothing
        with open(root / file.patch.path, "w", encoding="utf-8", newline="") as handle:
            handle.write(file.new_text)
    report.say(("Reverted" if report.reverse else "Applied") + ": changed "
               + ", ".join(f.patch.path for f in changed) + ".")
    return 0


def list_patch_sets(out: TextIO = None) -> int:
    out = out or sys.stdout
    for line in RELEASE_LINES:
        print(f"{line.name}: megatron-core {line.version[0]}.{line.version[1]}.x (made against {line.made_against})",
              file=out)
        for name, filename in PART_FILES:
            path = PATCH_DIR / line.name / filename
            if path.is_file():
                print(f"    {name:<9} {path}", file=out)
    return 0


# ----------------------------------------------------------------------------------------------------
# Command line


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
