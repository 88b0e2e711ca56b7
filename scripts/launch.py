#!/usr/bin/env python3
"""Launch the trainer from a YAML run config on one node or many (megatron_fp4.launch.torchrun).

    scripts/launch.py configs/proxy/gpus2.yaml [extra launcher flags ...]
    scripts/launch.py --dry-run CONFIG       # validate, print the environment and the torchrun command only
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout too

try:
    from megatron_fp4.launch.torchrun import main  # noqa: E402
except ModuleNotFoundError as err:  # an interpreter without the set-up's packages
    print(f"error: {sys.executable} cannot import {err.name}: run this with the set-up's .venv/bin/python or "
          "install the package into this interpreter (pip install -e .).", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
