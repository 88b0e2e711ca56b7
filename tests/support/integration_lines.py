"""TEST SUPPORT ONLY: megatron_fp4.launch's documented lines, applied to a Megatron-LM release's
training scripts as a user applies them (the project's stand-ins in tests/data/, or upstream's own
files in a scratch folder):

    python tests/support/integration_lines.py RELEASE SOURCE_FOLDER TARGET_FOLDER

copies pretrain_gpt.py (and gpt_builders.py, model_provider.py where present) with the lines of
RELEASE (0.18 or 0.19). The anchors are lines of upstream's files at core_v0.18.0 / core_v0.19.0,
which the stand-ins keep."""

import shutil
import sys
from pathlib import Path

import megatron_fp4.launch as fp4

PARSE_IMPORT = "from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args\n"
BUILDERS_IMPORT = "from megatron.training.arguments import core_transformer_config_from_args\n"
CONTAINER = "    full_config = pretrain_cfg_container_from_args(args, model_cfg)\n"


def documented_blocks() -> list:
    """The code blocks of the docstring (lines indented by four spaces), without their comments."""
    blocks, block = [], []
    for line in fp4.__doc__.splitlines():
        if line.startswith("    ") and line.strip():
            block.append(line.split("  #")[0].strip())
        elif block:
            blocks.append(block)
            block = []
    return blocks + ([block] if block else [])


def _once(text: str, anchor: str) -> str:
    assert text.count(anchor) == 1, anchor
    return anchor


def with_parse_line(text: str) -> str:
    """pretrain_gpt.py with the import and our parse_and_validate_args."""
    imported, parse = documented_blocks()[0][:2]
    assert parse == "args = fp4.parse_and_validate_args(...)"
    text = text.replace(_once(text, PARSE_IMPORT), PARSE_IMPORT + imported + "\n")
    return text.replace(_once(text, "    args = parse_and_validate_args("), "    args = fp4.parse_and_validate_args(")


def pretrain_gpt_0_19(text: str, spec_line: bool = True) -> str:
    """0.19's pretrain_gpt.py with the documented lines (the model-config line only if spec_line),
    that line right before the config container is built from model_cfg."""
    text = with_parse_line(text)
    if spec_line:
        text = text.replace(_once(text, CONTAINER), f"    {documented_blocks()[0][2]}\n{CONTAINER}")
    return text


def gpt_builders_0_18(text: str, mtp_line: bool = True) -> str:
    """0.18's gpt_builders.py with the import and the spec lines right before GPTModel (the MTP
    one only if mtp_line)."""
    imported = documented_blocks()[0][0]
    decoder_line, mtp = documented_blocks()[1]
    text = text.replace(_once(text, BUILDERS_IMPORT), BUILDERS_IMPORT + imported + "\n")
    spec_lines = [decoder_line, *([mtp] if mtp_line else [])]
    model = _once(text, "    model = GPTModel(\n")
    return text.replace(model, "".join(f"    {line}\n" for line in spec_lines) + model)


def apply(release: str, source: Path, target: Path, **lines) -> Path:
    """Copies of `source`'s scripts in `target` with `release`'s lines; `lines` leaves some out
    (spec_line=False for 0.19, mtp_line=False for 0.18)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in source.glob("*.py"):
        text = path.read_text()
        if path.name == "pretrain_gpt.py":
            text = pretrain_gpt_0_19(text, **lines) if release == "0.19" else with_parse_line(text)
        elif path.name == "gpt_builders.py" and release == "0.18":
            text = gpt_builders_0_18(text, **lines)
        (target / path.name).write_text(text)
    return target


if __name__ == "__main__":
    apply(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
    shutil.copy(Path(__file__).resolve().parents[1] / "data" / "megatron_lm_gpt_data.py", Path(sys.argv[3]).parent)
