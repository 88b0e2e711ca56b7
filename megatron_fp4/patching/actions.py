"""The actions of `megatron-fp4 patch`: check, apply and revert a tree (all parts or nothing),
and list the patch sets."""

import sys
from typing import Optional, TextIO

from .errors import PatchError
from .megatron_tree import detect_version, find_tree_root
from .patch_sets import PART_FILES, PATCH_DIR, check_part, load_parts
from .release_lines import RELEASE_LINES, release_line_for, release_line_named
from .report import PatchReport
from .unified_diff import APPLIED, APPLIES, CONFLICT


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
    report = PatchReport(root, line, version, forced=line_name is not None, reverse=action == "revert", out=out)
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
