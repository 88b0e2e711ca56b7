"""Stand-in for Megatron-LM 0.18's pretrain_gpt.py (tag core_v0.18.0), written for
tests/launch/test_user_pretrain_gpt.py: its call structure, trimmed. The main block parses and
validates the arguments, builds the config container and calls pretrain() with
partial(model_provider, gpt_builder): the model is built in gpt_builders.py next to it. The test
adds megatron_fp4.launch's lines for 0.18 to copies of this file and gpt_builders.py."""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpt_builders import gpt_builder
from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
# upstream's own import line, kept whole: tests/support/integration_lines.py adds the plugin's import after it
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron_lm_gpt_data import forward_step, train_valid_test_datasets_provider
from model_provider import model_provider

if __name__ == "__main__":
    args = parse_and_validate_args(
        extra_args_provider=None,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
    full_config = pretrain_cfg_container_from_args(args)
    pretrain(full_config, train_valid_test_datasets_provider, partial(model_provider, gpt_builder),
             ModelType.encoder_or_decoder, forward_step)
