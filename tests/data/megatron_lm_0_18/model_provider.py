"""Stand-in for Megatron-LM 0.18's model_provider.py: hands its arguments to the model builder."""

from megatron.training import get_args


def model_provider(model_builder, pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):
    return model_builder(get_args(), pre_process, post_process, vp_stage, config=config, pg_collection=pg_collection)
