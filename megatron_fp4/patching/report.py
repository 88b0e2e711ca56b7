"""What `megatron-fp4 patch` prints: each part's state and, for a conflict, where the file differs
from what the patch expects and the likely reason, in plain words."""

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from .megatron_tree import MegatronVersion
from .patch_sets import Part, PartResult
from .release_lines import ReleaseLine
from .unified_diff import APPLIED, APPLIES, CONFLICT, FileResult


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
class PatchReport:
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
