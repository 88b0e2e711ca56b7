"""Unified diffs read and applied in pure Python (no `patch` or `git` needed), strictly: every
context and removed line must match exactly (no fuzz), at any offset from the line the hunk names.

For each hunk it tells one of three things, which is what the `megatron-fp4 patch` command reports:
  - "applies": the lines it changes are there, as the diff expects;
  - "applied": they are not, but the lines it would produce are (the change is already in the file);
  - "conflict": neither; `Mismatch` then says where the file differs from what the hunk expects.

Text before the first `--- ` line of a patch file (a description) is ignored, as `patch` and
`git apply` ignore it. "\\ No newline at end of file" markers are not supported (our patches never
touch the last line of a file).
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")

APPLIES, APPLIED, CONFLICT = "applies", "applied", "conflict"


class PatchFormatError(ValueError):
    """A patch file that is not a unified diff this module can apply."""


@dataclass
class Hunk:
    number: int  # 1-based, within its file
    old_start: int  # 1-based line numbers, as in the @@ header
    new_start: int
    section: str  # the function name after the second @@ (may be empty)
    lines: List[Tuple[str, str]]  # (" " | "-" | "+", text without its newline)

    @property
    def old(self) -> List[str]:
        return [text for tag, text in self.lines if tag != "+"]

    @property
    def new(self) -> List[str]:
        return [text for tag, text in self.lines if tag != "-"]

    @property
    def header(self) -> str:
        head = f"@@ -{self.old_start},{len(self.old)} +{self.new_start},{len(self.new)} @@"
        return f"{head} {self.section}" if self.section else head

    def reversed(self) -> "Hunk":
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(self.number, self.new_start, self.old_start, self.section,
                    [(swap[tag], text) for tag, text in self.lines])


@dataclass
class FilePatch:
    path: str  # relative to the tree's root (the a/ b/ prefix stripped, as `patch -p1` does)
    hunks: List[Hunk] = field(default_factory=list)

    def reversed(self) -> "FilePatch":
        return FilePatch(self.path, [h.reversed() for h in self.hunks])


def _strip_prefix(name: str) -> str:
    name = name.split("\t")[0].strip()
    if name == "/dev/null":
        raise PatchFormatError("file creation and deletion are not supported")
    return name.split("/", 1)[1] if "/" in name else name


def parse(text: str, source: str = "patch") -> List[FilePatch]:
    """The files and hunks of a unified diff; PatchFormatError (naming `source`) when malformed."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    files: List[FilePatch] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not (line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            if files and line.startswith("@@"):
                raise PatchFormatError(f"{source}, line {i + 1}: a hunk outside the counted lines of the one before")
            i += 1  # description text, or `diff --git` / `index` lines
            continue
        current = FilePatch(_strip_prefix(lines[i + 1][4:]))
        files.append(current)
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            match = _HUNK_HEADER.match(lines[i])
            if not match:
                raise PatchFormatError(f"{source}, line {i + 1}: unreadable hunk header {lines[i]!r}")
            old_len = int(match.group(2) or 1)
            new_len = int(match.group(4) or 1)
            hunk = Hunk(len(current.hunks) + 1, int(match.group(1)), int(match.group(3)), match.group(5).strip(), [])
            i += 1
            seen_old = seen_new = 0
            while seen_old < old_len or seen_new < new_len:
                if i >= len(lines):
                    raise PatchFormatError(f"{source}: hunk {hunk.header} of {current.path} ends early")
                body = lines[i]
                tag, rest = (body[:1], body[1:]) if body else (" ", "")  # an empty line is blank context
                if tag == "\\":
                    raise PatchFormatError(f"{source}, line {i + 1}: 'No newline at end of file' is not supported")
                if tag not in " -+":
                    raise PatchFormatError(
                        f"{source}, line {i + 1}: hunk {hunk.header} of {current.path} has fewer lines than its "
                        "header counts"
                    )
                hunk.lines.append((tag, rest))
                seen_old += tag != "+"
                seen_new += tag != "-"
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise PatchFormatError(f"{source}: hunk {hunk.header} of {current.path} does not match its line counts")
            current.hunks.append(hunk)
        if not current.hunks:
            raise PatchFormatError(f"{source}: no hunk for {current.path}")
    if not files:
        raise PatchFormatError(f"{source}: no unified diff in it")
    return files


@dataclass
class Mismatch:
    """Where a conflicting hunk fits best, and the lines that differ there."""

    line: int  # 1-based line of the file where the best-matching window starts
    agree: int  # how many of the hunk's expected lines agree there
    total: int
    differences: List[Tuple[int, str, Optional[str]]]  # (file line, expected, found or None past the end)


@dataclass
class HunkResult:
    hunk: Hunk
    status: str  # APPLIES, APPLIED or CONFLICT
    line: Optional[int] = None  # 1-based: where it applies, or where its result was found
    mismatch: Optional[Mismatch] = None

    @property
    def offset(self) -> int:
        return 0 if self.line is None else self.line - self.hunk.old_start


@dataclass
class FileResult:
    patch: FilePatch
    status: str  # APPLIES, APPLIED, "partly", CONFLICT or "missing"
    hunks: List[HunkResult]
    new_text: Optional[str] = None  # the patched file, when status is APPLIES


class TextFile:
    """A text file as lines without their endings, written back with the ending it had."""

    def __init__(self, text: str):
        self.newline = "\r\n" if "\r\n" in text else "\n"
        self.final_newline = text.endswith("\n")
        body = text[: -len(self.newline)] if text.endswith(self.newline) else text
        self.lines = body.split(self.newline) if text else []

    def render(self, lines: List[str]) -> str:
        text = self.newline.join(lines)
        return text + self.newline if lines and self.final_newline else text


def _find(lines: List[str], block: List[str], start: int, expected: int) -> Optional[int]:
    """Index (0-based) of the occurrence of `block` at or after `start` nearest to `expected`."""
    if not block:
        return max(start, min(expected, len(lines)))
    best = None
    for i in range(start, len(lines) - len(block) + 1):
        if lines[i] == block[0] and lines[i : i + len(block)] == block:
            if best is None or abs(i - expected) < abs(best - expected):
                best = i
    return best


def _diagnose(lines: List[str], block: List[str], expected: int) -> Mismatch:
    """The window of the file most like `block` (ties: nearest to `expected`) and how it differs."""
    best_i, best_score = max(0, min(expected, len(lines) - 1)), -1
    for i in range(0, max(1, len(lines) - len(block) + 1)):
        score = sum(1 for k, want in enumerate(block) if i + k < len(lines) and lines[i + k] == want)
        if score > best_score or (score == best_score and abs(i - expected) < abs(best_i - expected)):
            best_i, best_score = i, score
    differences = []
    for k, want in enumerate(block):
        found = lines[best_i + k] if best_i + k < len(lines) else None
        if found != want:
            differences.append((best_i + k + 1, want, found))
    return Mismatch(best_i + 1, max(best_score, 0), len(block), differences)


def check_text(text: str, patch: FilePatch) -> FileResult:
    """How `patch` stands against `text` (a file's content); the patched text when it applies."""
    source = TextFile(text)
    lines = source.lines
    results: List[HunkResult] = []
    replacements = []  # (start, end, new lines) in the original file
    position, drift = 0, 0  # search from the end of the previous hunk, at the previous hunk's offset
    for hunk in patch.hunks:
        expected = hunk.old_start - 1 + drift
        at = _find(lines, hunk.old, position, expected)
        if at is not None:
            results.append(HunkResult(hunk, APPLIES, at + 1))
            replacements.append((at, at + len(hunk.old), hunk.new))
            position, drift = at + len(hunk.old), at - (hunk.old_start - 1)
            continue
        at = _find(lines, hunk.new, position, hunk.new_start - 1 + drift)
        if at is not None:
            results.append(HunkResult(hunk, APPLIED, at + 1))
            position, drift = at + len(hunk.new), at - (hunk.new_start - 1)
            continue
        results.append(HunkResult(hunk, CONFLICT, mismatch=_diagnose(lines, hunk.old, expected)))
    statuses = {r.status for r in results}
    if statuses == {APPLIES}:
        out, last = [], 0
        for start, end, new in replacements:
            out += lines[last:start] + new
            last = end
        out += lines[last:]
        return FileResult(patch, APPLIES, results, source.render(out))
    if statuses == {APPLIED}:
        return FileResult(patch, APPLIED, results)
    if CONFLICT in statuses:
        return FileResult(patch, CONFLICT, results)
    return FileResult(patch, "partly", results)


def check_file(root: Path, patch: FilePatch) -> FileResult:
    """`check_text` on the file `patch.path` under `root` ("missing" when it is not there)."""
    path = Path(root) / patch.path
    if not path.is_file():
        return FileResult(patch, "missing", [])
    with open(path, encoding="utf-8", newline="") as handle:  # newline="": keep \r\n as it is
        return check_text(handle.read(), patch)


__all__ = [
    "APPLIED",
    "APPLIES",
    "CONFLICT",
    "FilePatch",
    "FileResult",
    "Hunk",
    "HunkResult",
    "Mismatch",
    "PatchFormatError",
    "TextFile",
    "check_file",
    "check_text",
    "parse",
]
