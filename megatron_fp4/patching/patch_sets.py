"""The patch files of a release line (a core part and a training part), read and checked against
a tree."""

from dataclasses import dataclass
from pathlib import Path
from typing import List

from .errors import PatchError
from .release_lines import ReleaseLine
from .unified_diff import APPLIED, APPLIES, CONFLICT, FilePatch, FileResult, PatchFormatError, check_file, parse

PATCH_DIR = Path(__file__).resolve().parent / "patches"
PART_FILES = (("core", "core.patch"), ("training", "training.patch"))


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
