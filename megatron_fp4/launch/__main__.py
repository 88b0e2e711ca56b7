"""python -m megatron_fp4.launch <Megatron flags> [our flags]: the same as scripts/pretrain_gpt_fp4.py."""

from .pretrain import main

main()
