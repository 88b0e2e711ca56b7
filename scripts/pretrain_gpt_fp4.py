#!/usr/bin/env python3
"""Pretrain a MoE GPT with Megatron and our flags (megatron_fp4.launch; see its docstring).

    torchrun --nproc-per-node 2 scripts/pretrain_gpt_fp4.py <Megatron flags> [--moe-fp4-dispatch]
    python scripts/pretrain_gpt_fp4.py --help        # Megatron's flags and ours (group megatron_fp4)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a plain checkout too

from megatron_fp4.console import quiet_third_party_notices  # noqa: E402

quiet_third_party_notices()  # before Megatron is imported

from megatron_fp4.launch import main  # noqa: E402

if __name__ == "__main__":
    main()
