"""The flags and refusals tables of docs/usage.md, generated from `FLAGS` and `REFUSALS`."""

import re

from .flags import FLAGS
from .refusals import REFUSALS


def usage_markdown() -> str:
    """The flags and refusals tables of docs/usage.md."""
    lines = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for flag in FLAGS:
        default = "off" if flag.choices is None else "none" if flag.many else f"`{flag.default.value}`"
        choices = "" if flag.choices is None else " {" + ",".join(c.value for c in flag.choices) + "}" + (
            " ..." if flag.many else "")
        lines.append(f"| `{flag.option}`{choices} | {default} | {flag.help} |")
    lines += ["", "| refused | message |", "| --- | --- |"]
    for refusal in REFUSALS:
        message = re.sub(r"\{(\w+)\}", r"<\1>", refusal.message)  # the values the user's run fills in
        lines.append(f"| {refusal.when} | {message} |")
    return "\n".join(lines) + "\n"

