"""Stand-in for Megatron-LM 0.19's pretrain_gpt.py (tag core_v0.19.0), written for
tests/launch/test_user_pretrain_gpt.py: its call structure, trimmed. The main block parses and
validates the arguments, turns them into a GPTModelConfig (gpt_config_from_args), puts it in the
config container and calls pretrain() without a model provider: the megatron-core wheel builds the
model (GPTModelBuilder, mtp_block_spec in megatron/training/models/gpt.py). The test adds
megatron_fp4.launch's lines for 0.19 to a copy of this file."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
# upstream's own import line, kept whole: tests/support/integration_lines.py adds the plugin's import after it
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron_lm_gpt_data import forward_step, train_valid_test_datasets_provider

if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    model_cfg = gpt_config_from_args(args)
    full_config = pretrain_cfg_container_from_args(args, model_cfg)
    pretrain(full_config, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)
