"""TEST SUPPORT ONLY: a user's training script (a Megatron-LM stand-in) run as `__main__` in one
CPU process set up as a GPU machine (training_on_cpu.py), one rank:

    python tests/support/user_script_on_cpu.py MEGATRON_FOLDER PORT SCRIPT [script arguments...]

MEGATRON_FOLDER, unless '-', goes first on sys.path (a megatron-core release installed there, as
tests/versions does); the script's own folder goes first after it, as when Python runs a script.
The first line on stderr names the megatron-core version imported."""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(megatron_folder: str, port: int, script: str, argv: list) -> None:
    if megatron_folder != "-":
        sys.path.insert(0, megatron_folder)
    from support import training_on_cpu

    training_on_cpu.prepare(0, 1, port)
    import megatron.core

    print(f"megatron-core {megatron.core.__version__}", file=sys.stderr, flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
