"""The megatron-core release lines that have a patch set, and which one serves a tree."""

from dataclasses import dataclass
from typing import Tuple

from .errors import PatchError
from .megatron_tree import MegatronVersion


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
