"""python -m megatron_fp4.launch <Megatron flags> [our flags]: the same as scripts/pretrain_gpt_fp4.py."""

from ..console import quiet_third_party_notices

quiet_third_party_notices()  # before Megatron is imported

from .pretrain import main  # noqa: E402

main()
