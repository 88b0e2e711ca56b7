"""TEST SUPPORT ONLY: Megatron's training-loop checkpointing (megatron.training.checkpointing's
save_checkpoint / load_checkpoint, as pretrain() calls them) in a rank process of
tests/support/checkpoint_scenarios.py, and a model's state in a form that does not depend on the
expert-parallel layout.

The training functions read Megatron's global arguments: `use_arguments` parses a command line with
Megatron's own parser, fills in what its validate_args derives that checkpointing reads, and makes
it the global arguments."""

import argparse

import torch
import torch.distributed as dist

NUM_EXPERTS = 4  # checkpoint_scenarios.build_model's


def use_arguments(flags: list) -> argparse.Namespace:
    """Megatron's arguments for the tiny model of checkpoint_scenarios.build_model plus `flags`,
    set as its global arguments (replacing any); checkpoints go to / come from --save / --load."""
    from megatron.core import num_microbatches_calculator, parallel_state
    from megatron.training import global_vars
    from megatron.training.arguments import add_megatron_arguments
    from megatron.training.utils import update_use_dist_ckpt

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args([
        "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128", "--swiglu",
        "--disable-bias-linear", "--bf16", "--transformer-impl", "local", "--use-distributed-optimizer",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
        "--global-batch-size", str(2 * dist.get_world_size()), "--ckpt-format", "torch_dist",
        "--expert-model-parallel-size", str(parallel_state.get_expert_model_parallel_world_size()),
        *flags])
    args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
    args.data_parallel_size = parallel_state.get_data_parallel_world_size()
    update_use_dist_ckpt(args)
    global_vars.set_args(args)
    if num_microbatches_calculator._GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:  # load_checkpoint updates it
        num_microbatches_calculator.init_num_microbatches_calculator(
            args.rank, None, args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
    return args


def save(run, iteration: int) -> None:
    """Megatron's save_checkpoint of a checkpoint_scenarios.Run to --save (no LR scheduler)."""
    from megatron.training.checkpointing import save_checkpoint

    save_checkpoint(iteration, [run.model], run.optimizer, None, 0)


def load(run) -> int:
    """Megatron's load_checkpoint of --load into a checkpoint_scenarios.Run; the iteration it
    resumes from (0 under --finetune)."""
    from megatron.training import get_args
    from megatron.training.checkpointing import load_checkpoint

    args = get_args()
    if not args.finetune and not args.no_load_optim:
        # Without Apex / TE, Megatron's DistributedOptimizer needs Adam's state to exist before it
        # is loaded over (checkpoint_scenarios.Run.load).
        for optimizer in run.optimizer.chained_optimizers:
            optimizer._init_optimizer_states_with_dummy_values()
    iteration, _ = load_checkpoint([run.model], run.optimizer, None)
    return iteration


def forget_arguments() -> None:
    """No global arguments again, as in a process that does not run Megatron's training loop."""
    from megatron.training import global_vars

    global_vars.set_args(None)


def _global_name(name: str) -> str:
    """The parameter's name with its local expert index made the global one."""
    from megatron.core import parallel_state

    marker = ".local_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker, 1)
    local, rest = tail.split(".", 1)
    # Megatron's experts: each EP rank holds a contiguous run of num_local_experts.
    num_local = NUM_EXPERTS // parallel_state.get_expert_model_parallel_world_size()
    return f"{head}{marker}{parallel_state.get_expert_model_parallel_rank() * num_local + int(local)}.{rest}"


def layout_free_state(run) -> dict:
    """(parameter name with global expert indices, "weight" / "param" / "exp_avg" / "exp_avg_sq" /
    "step") -> the whole tensor, flattened, the same on every rank: the model's weights and the
    distributed optimizer's fp32 main weights and Adam state, gathered from every rank's shard."""
    names = {id(p): n for n, p in run.model.named_parameters()}
    mine = {(_global_name(name), "weight"): (0, param.detach().reshape(-1).clone())
            for name, param in run.model.named_parameters()}
    for optimizer in run.optimizer.chained_optimizers:
        for param in optimizer.model_param_group_index_map:
            start = optimizer._get_model_param_range_map(param)["param"].start
            for kind, tensor in optimizer._get_main_param_and_optimizer_states(param).items():
                # Adam's step is one number per parameter, on each rank holding a piece of it.
                mine[_global_name(names[id(param)]), kind] = (0 if tensor.dim() == 0 else start,
                                                              tensor.detach().reshape(-1).clone())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    pieces = {}
    for found in everyone:
        for key, (start, values) in found.items():
            held = pieces.setdefault(key, {})
            if start in held:
                assert _bits(held[start]).equal(_bits(values)), f"{key}: ranks hold different values"
            held[start] = values
    whole = {}
    for key, held in pieces.items():
        starts = sorted(held)
        assert all(held[a].numel() + a == b for a, b in zip(starts, starts[1:])) and starts[0] == 0, \
            f"{key}: pieces at {starts} do not tile it"
        whole[key] = torch.cat([held[start] for start in starts])
    for (name, kind), tensor in whole.items():
        numel = 1 if kind == "step" else whole[name, "weight"].numel()
        assert tensor.numel() == numel, f"{(name, kind)}: the ranks hold {tensor.numel()} of {numel} values"
    return whole


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def differing(a: dict, b: dict) -> list:
    """The keys only one side has, and those whose tensors differ in a bit."""
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not (
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and _bits(a[k]).equal(_bits(b[k])))]
