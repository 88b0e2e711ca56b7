"""A Megatron-LM or megatron-core source tree: where its root is and which megatron-core release
it holds (read from megatron/core/package_info.py without importing it)."""

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

from .errors import PatchError


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
