"""Distributed-optimizer checkpoint formats that FP8 experts can share with stock Megatron.

Megatron's default distributed-optimizer format ('dp_reshardable', the default when
--dist-ckpt-optim-fully-reshardable is off) stores each gradient bucket's optimizer state as one
flat tensor in the order the bucket holds the parameters. FP8Experts (like SequentialMLP) hold
each expert's fc1 and fc2 in turn; TEGroupedMLP (--moe-grouped-gemm with Transformer Engine)
holds all experts' fc1, then all fc2. The flat tensors have the same size, so a checkpoint
saved by one and loaded by the other loads without error with the Adam state and fp32 main
weights of one expert weight put on another. The model-space formats key each parameter's state
by its name and carry over. The saver cannot know who will load, so both ends refuse the optimizer
state in that format.

The weights are keyed by name in every format: a run that takes no optimizer state from such a
checkpoint (--finetune, --no-load-optim) and writes none in that format (its own saves fully
reshardable, --no-save-optim, or no --save) loads its weights. Megatron's training loop passes the model the checkpoint's format at load and this run's at
save, but not whether the optimizer takes part; its training arguments say that. Without them
(dist_checkpointing called directly) every use of the format is refused."""

from typing import Optional

from ..options import UnsupportedConfiguration

# Megatron's sharding types (DistributedOptimizer.sharded_state_dict) that store the state in
# bucket space, i.e. by parameter order.
BUCKET_SPACE_FORMATS = ("dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space")

REFUSAL = (
    "--moe-fp4-experts fp8 cannot save or load the distributed optimizer's {sharding!r} checkpoint "
    "format (optimizer state stored in parameter order, which differs from Megatron's grouped "
    "experts); add --dist-ckpt-optim-fully-reshardable."
)
# A checkpoint in that format loaded by a run whose own saves use a model-space format.
LOAD_REFUSAL = (
    "--moe-fp4-experts fp8 cannot load the distributed optimizer's state from a {sharding!r} checkpoint "
    "(stored in parameter order, which differs from Megatron's grouped experts): add --no-load-optim or "
    "--finetune to load its weights only, or resume it once without --moe-fp4-experts fp8 and with "
    "--dist-ckpt-optim-fully-reshardable and load the checkpoint that run saves."
)


class OptimizerCheckpointFormatUnsupported(UnsupportedConfiguration):
    """The distributed optimizer's checkpoint format cannot carry FP8 experts' state across."""


def _training_arguments():
    """Megatron's training arguments when its training loop (megatron.training) runs here, else None."""
    import sys

    global_vars = sys.modules.get("megatron.training.global_vars")
    if global_vars is None:
        return None
    try:
        return global_vars.get_args()
    except AssertionError:  # not initialized
        return None


def _saves_in_bucket_space(args) -> bool:
    """Whether Megatron's save_checkpoint gives this run's optimizer a bucket-space format
    (_build_sharded_state_dict_metadata)."""
    distributed = getattr(args, "use_distributed_optimizer", False) or getattr(
        args, "use_layer_wise_distributed_optimizer", False)
    return bool(distributed and getattr(args, "ckpt_format", None) != "fsdp_dtensor"
                and not getattr(args, "dist_ckpt_optim_fully_reshardable", False))


def check_optimizer_checkpoint_format(metadata: Optional[dict]) -> None:
    """Refuse a bucket-space distributed-optimizer format where optimizer state may go through it.
    `metadata` is the sharded_state_dict metadata Megatron passes to the model at save (built from
    the arguments) and at load (read from the checkpoint): its 'distrib_optim_sharding_type' names
    the optimizer's format."""
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    if sharding not in BUCKET_SPACE_FORMATS:
        return
    args = _training_arguments()
    if args is None:
        raise OptimizerCheckpointFormatUnsupported(REFUSAL.format(sharding=sharding))
    # What Megatron's save_checkpoint and load_checkpoint (generate_state_dict) do with the optimizer.
    saves_optimizer = bool(getattr(args, "save", None)) and not getattr(args, "no_save_optim", False)
    loads_optimizer = not getattr(args, "finetune", False) and not getattr(args, "no_load_optim", False)
    if _saves_in_bucket_space(args):
        # A save or a load: either may carry optimizer state in this format.
        if saves_optimizer or loads_optimizer:
            raise OptimizerCheckpointFormatUnsupported(REFUSAL.format(sharding=sharding))
    elif loads_optimizer:  # this run saves in another format: the metadata is a checkpoint's at load
        raise OptimizerCheckpointFormatUnsupported(LOAD_REFUSAL.format(sharding=sharding))


__all__ = ["BUCKET_SPACE_FORMATS", "LOAD_REFUSAL", "OptimizerCheckpointFormatUnsupported", "REFUSAL",
           "check_optimizer_checkpoint_format"]
