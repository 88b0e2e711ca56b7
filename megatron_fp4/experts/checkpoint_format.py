"""Distributed-optimizer checkpoint formats that FP8 experts can share with stock Megatron.

Megatron's default distributed-optimizer format ('dp_reshardable', the default when
--dist-ckpt-optim-fully-reshardable is off) stores each gradient bucket's optimizer state as one
flat tensor in the order the bucket holds the parameters. FP8Experts (like SequentialMLP) hold
each expert's fc1 and fc2 in turn; TEGroupedMLP (--moe-grouped-gemm with Transformer Engine)
holds all experts' fc1, then all fc2. The flat tensors have the same size, so a checkpoint
saved by one and loaded by the other loads without error with the Adam state and fp32 main
weights of one expert weight put on another. The model-space formats key each parameter's state
by its name and carry over. The saver cannot know who will load, so both ends refuse."""

from typing import Optional

# Megatron's sharding types (DistributedOptimizer.sharded_state_dict) that store the state in
# bucket space, i.e. by parameter order.
BUCKET_SPACE_FORMATS = ("dp_reshardable", "dp_zero_gather_scatter", "fully_sharded_bucket_space")

REFUSAL = (
    "--moe-fp4-experts fp8 cannot save or load the distributed optimizer's {sharding!r} checkpoint "
    "format (optimizer state stored in parameter order, which differs from Megatron's grouped "
    "experts); add --dist-ckpt-optim-fully-reshardable."
)


class OptimizerCheckpointFormatUnsupported(ValueError):
    """The distributed optimizer's checkpoint format cannot carry FP8 experts' state across."""


def check_optimizer_checkpoint_format(metadata: Optional[dict]) -> None:
    """Refuse a bucket-space distributed-optimizer format. `metadata` is the sharded_state_dict
    metadata Megatron passes to the model at save (built from the arguments) and at load (read
    from the checkpoint): its 'distrib_optim_sharding_type' names the optimizer's format."""
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    if sharding in BUCKET_SPACE_FORMATS:
        raise OptimizerCheckpointFormatUnsupported(REFUSAL.format(sharding=sharding))


__all__ = ["BUCKET_SPACE_FORMATS", "OptimizerCheckpointFormatUnsupported", "REFUSAL",
           "check_optimizer_checkpoint_format"]
