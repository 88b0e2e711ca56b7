"""The model-level checkpoint scenarios (tests/distributed/test_checkpoints.py), run by both ranks:
two gloo ranks on the CPU with torch.cuda emulated (tests/support/cuda_on_cpu.py), EP 2 (experts
0-1 on rank 0, 2-3 on rank 1; the dense part data-parallel over both ranks). A tiny GPTModel (2 MoE
layers, hidden 128, 4 experts top-2, alltoall, SwiGLU, no bias, local spec), Megatron's DDP and
distributed Adam (bf16 weights, fp32 main weights), saved and loaded with
megatron.core.dist_checkpointing the way Megatron's training loop does it; the moves between runs
(stock_checkpoint, flag_and_layout_changes) call the training loop's own save_checkpoint /
load_checkpoint with Megatron's parsed arguments (megatron_checkpointing.py), at EP 1 too.

"Plugin" is the whole FP4 recipe (FP4 dispatch, FP8 experts, FP8 linear layers, every saved input
in MXFP4); "stock" the same spec without it (SequentialMLP, Megatron's local linears and alltoall
dispatcher)."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH = 512, 32, 2
SAVE_AT, LAST = 2, 4  # optimizer steps before the save, and in all
# Loss differences plugin <-> stock after the load, from the measurement in cross_load.
FIRST_STEP_BOUND, LATER_STEP_BOUND = 1.8e-3, 1.8e-3
# The first loss after FP8 experts resume a dispatch-only run, against that run's (same weights,
# other experts' rounding): 1.7e-5 measured (flag_and_layout_changes).
FP8_EXPERTS_FIRST_STEP_BOUND = 2e-4

# FP4 flag sets by name (besides the whole recipe, plugin=True): what a user may resume with.
FLAG_SETS = {"dispatch": dict(dispatch=True), "dispatch, fp8 experts": dict(dispatch=True, experts="fp8")}


def build_model(plugin, seed: int, ep: int = 2):
    """The tiny GPTModel at expert-parallel size `ep`; `plugin`: True for the whole FP4 recipe, False
    for none, or a name in FLAG_SETS. The one place that knows the plugin's API."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_fp4.integration import FP4Options, use_fp4

    config = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, num_moe_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=128, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, transformer_impl="local",
    )
    spec = get_gpt_layer_local_spec(num_experts=4)
    if plugin:
        flags = FLAG_SETS[plugin] if isinstance(plugin, str) else dict(dispatch=True, experts="fp8", linears="fp8",
                                                                        storage="all")
        spec = use_fp4(spec, FP4Options(**flags))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


class Run:
    """A model in Megatron's DDP with Megatron's distributed Adam, trained on fixed batches."""

    def __init__(self, plugin, seed: int, overlap_param_gather: bool = False, ep: int = 2):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        self.gpt = gpt = build_model(plugin, seed, ep)
        self.model = DistributedDataParallel(
            gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                                      overlap_param_gather=overlap_param_gather),
            Float16Module(gpt.config, gpt))
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=3e-3, bf16=True, use_distributed_optimizer=True, clip_grad=1.0),
            [self.model])
        self.names = {id(p): n for n, p in self.model.named_parameters()}

    def step(self, step: int) -> torch.Tensor:
        """One optimizer step on batch `step` (each rank its own); the loss averaged over ranks."""
        from megatron.core.distributed import finalize_model_grads

        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self.model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        finalize_model_grads([self.model])
        updated, _, _ = self.optimizer.step()
        assert updated
        loss = loss.detach()
        dist.all_reduce(loss)
        return loss / dist.get_world_size()

    def _sharded_state_dict(self, metadata, loading: bool):
        # Megatron's checkpointing works on the unwrapped model (unwrap_model).
        state = {"model": self.gpt.sharded_state_dict(metadata=metadata)}
        state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
        return state

    def save(self, directory: str, fully_reshardable: bool = True) -> None:
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        metadata = save_metadata(fully_reshardable)
        state = self._sharded_state_dict(metadata, loading=False)
        # As Megatron's save: the metadata is stored, less the process group.
        dist_checkpointing.save(state, directory, content_metadata={k: v for k, v in metadata.items()
                                                                     if k != "dp_cp_group"})

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing, parallel_state

        # Without Apex / TE, Megatron's DistributedOptimizer.state_dict needs Adam's state to exist
        # before it is loaded over (it reads 'step'): create it as Megatron does for loading.
        for optimizer in self.optimizer.chained_optimizers:
            optimizer._init_optimizer_states_with_dummy_values()
        metadata = dist_checkpointing.load_content_metadata(directory)
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
        state = dist_checkpointing.load(self._sharded_state_dict(metadata, loading=True), directory)
        self.gpt.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def optimizer_state(self) -> dict:
        """(parameter name, "param" / "exp_avg" / "exp_avg_sq") -> this rank's fp32 shard."""
        found = {}
        for optimizer in self.optimizer.chained_optimizers:
            for param in optimizer.model_param_group_index_map:
                for kind, tensor in optimizer._get_main_param_and_optimizer_states(param).items():
                    found[self.names[id(param)], kind] = tensor.detach().clone()
        return found


def save_metadata(fully_reshardable: bool) -> dict:
    """What Megatron's training passes to sharded_state_dict at save, by --dist-ckpt-optim-fully-reshardable."""
    from types import SimpleNamespace

    from megatron.training.checkpointing import _build_sharded_state_dict_metadata

    args = SimpleNamespace(use_distributed_optimizer=True, ckpt_format="torch_dist",
                           dist_ckpt_optim_fully_reshardable=fully_reshardable,
                           distrib_optim_fully_reshardable_mem_efficient=False)
    return _build_sharded_state_dict_metadata(args)


def _differing(a: dict, b: dict) -> list:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:4]
    return [k for k in a if not torch.equal(a[k], b[k])]


# --- scenarios (run on each rank) ---------------------------------------------------------------

def log(*what):
    print(f"[{time.strftime('%X')}] rank {dist.get_rank()}:", *what, flush=True)


def _save_and_continue(saver_plugin: bool, loader_plugins, directory: str):
    """The saver trains SAVE_AT steps, saves, and goes on to LAST; each loader (another init, one
    per entry of loader_plugins) loads that checkpoint and trains the same steps. Returns the saver,
    its losses after the save and, per loader, (loader, its losses after the load, what did not come
    through the checkpoint bit for bit). Nothing is asserted here: every rank runs every step (the
    steps communicate) before any check can stop one."""
    saver = Run(plugin=saver_plugin, seed=1)
    for step in range(SAVE_AT):
        saver.step(step)
    saver.save(directory)
    saved_parameters, saved_state = saver.parameters(), saver.optimizer_state()
    continued = torch.stack([saver.step(step) for step in range(SAVE_AT, LAST)])
    loaders = []
    for loader_plugin in loader_plugins:
        loader = Run(plugin=loader_plugin, seed=2)
        loader.load(directory)
        lost = [f"{what} changed through the checkpoint: {differing[:4]} of {len(differing)}"
                for what, differing in (("weights", _differing(saved_parameters, loader.parameters())),
                                        ("optimizer state", _differing(saved_state, loader.optimizer_state())))
                if differing]
        resumed = torch.stack([loader.step(step) for step in range(SAVE_AT, LAST)])
        log(f"losses after the save: saver {continued.tolist()}, loader (plugin {loader_plugin}) {resumed.tolist()}")
        loaders.append((loader, resumed, lost))
    return saver, continued, loaders


def _cross_load_problems(continued, resumed, lost) -> list:
    difference = (continued - resumed).abs()
    # Measured with the whole recipe at hidden 128 (bounds about twice the largest): plugin -> stock
    # 8.8e-4 then 5.2e-5, stock -> plugin 1.0e-4 then 5.8e-4 (losses ~6.26, 6.28; a step moves them
    # by ~0.01-0.05). The first step after the load has the same weights on both sides: only the
    # recipe's rounding (FP4 dispatch, FP8 GEMMs, MXFP4-saved inputs) differs; after that the
    # updates differ too. (At hidden 256: 1.96e-4 then 7.4e-4, and 1.50e-4 then 1.32e-3.)
    if not (difference[0] <= FIRST_STEP_BOUND and difference.max() <= LATER_STEP_BOUND):
        lost = lost + [f"losses after the load {resumed.tolist()} vs the saver's {continued.tolist()}"]
    return lost


def _resume_problems(saver, continued, loader, resumed, lost) -> list:
    if not torch.equal(continued, resumed):
        lost = lost + [f"resumed losses {resumed.tolist()} != uninterrupted {continued.tolist()}"]
    if _differing(saver.parameters(), loader.parameters()):
        lost = lost + ["resumed weights differ"]
    if _differing(saver.optimizer_state(), loader.optimizer_state()):
        lost = lost + ["resumed optimizer state differs"]
    return lost


def cross_load(saver_plugin: bool, directory: str) -> None:
    _, continued, [(_, resumed, lost)] = _save_and_continue(saver_plugin, [not saver_plugin], directory)
    problems = _cross_load_problems(continued, resumed, lost)
    assert not problems, "; ".join(problems)


def plugin_saver(results: str, directory: str) -> None:
    """resume and cross_load(saver_plugin=True) from one plugin saver (its steps, the most costly
    part, once): a plugin loader and a stock loader of the same checkpoint. Writes this rank's
    problems by scenario, as JSON, to results/rank<R>.json; asserts nothing."""
    saver, continued, [(plugin, plugin_resumed, plugin_lost), (_, stock_resumed, stock_lost)] = _save_and_continue(
        True, [True, False], directory)
    problems = {"resume": _resume_problems(saver, continued, plugin, plugin_resumed, plugin_lost),
                "cross_load": _cross_load_problems(continued, stock_resumed, stock_lost)}
    with open(os.path.join(results, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(problems, f)


class GroupedLinearLikeTE(torch.nn.Module):
    """Stands in for Transformer Engine's GroupedLinear (not installed here) where only parameter
    order matters: TE registers one module's weight0 .. weight{n-1}, in expert order."""

    def __init__(self, num_gemms, input_size, output_size, *, config, is_expert, **unused):
        super().__init__()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.zeros(output_size, input_size, dtype=config.params_dtype))
            weight.allreduce = not is_expert  # how Megatron marks expert parameters for DDP
            self.register_parameter(f"weight{i}", weight)


def _bucket_layout(model) -> dict:
    """(layer, fc1 / fc2, expert) -> (start, end, bucket) in the DDP expert buffer, which is
    where the 'dp_reshardable' format puts each expert weight's optimizer state."""
    import re

    found = {}
    for name, param in model.named_parameters():
        # SequentialMLP / FP8Experts: ...experts.local_experts.E.linear_fcN.weight; grouped: ...experts.linear_fcN.weightE
        match = (re.search(r"layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$", name)
                 or re.search(r"layers\.(\d+)\.mlp\.experts\.()(linear_fc\d)\.weight(\d+)$", name))
        if match:
            layer, expert, fc = match.group(1), match.group(2) or match.group(4), match.group(3)
            (buffer,) = model.expert_parallel_buffers
            found[layer, fc, expert] = buffer.param_index_map[param]
    return found


def bucket_format(directory: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_fp4.experts.checkpoint_format import OptimizerCheckpointFormatUnsupported, check_optimizer_checkpoint_format

    # Ours and SequentialMLP hold the parameters in the same order: in bucket space their states
    # would interchange (a save by ours loaded by stock gave bit-identical state before the refusal).
    ours, stock = Run(plugin=True, seed=1), Run(plugin=False, seed=2)
    assert _bucket_layout(ours.model) == _bucket_layout(stock.model), "FP8Experts' buckets differ from SequentialMLP's"

    # Megatron's grouped experts hold all fc1, then all fc2: the same bytes, other places.
    # A bucket-space checkpoint of one would put each weight's state at another's place in the other.
    gpt = build_model(plugin=False, seed=3)
    for layer in gpt.decoder.layers:
        layer.mlp.experts = TEGroupedMLP(2, gpt.config, GroupedMLPSubmodules(GroupedLinearLikeTE, GroupedLinearLikeTE),
                                         pg_collection=get_default_pg_collection())
    grouped = _bucket_layout(DistributedDataParallel(
        gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=True), gpt))
    layout = _bucket_layout(ours.model)
    assert grouped.keys() == layout.keys() and len(layout) == 8, sorted(layout)
    moved = [key for key in layout if grouped[key] != layout[key]]
    assert moved, "grouped experts' buckets now match ours: the refusal may be lifted"

    # So FP8Experts refuse the bucket-space format at save (metadata from the arguments) and at
    # load (metadata read from a stock checkpoint), and accept the fix, which stock loads.
    for optimizer in ours.optimizer.chained_optimizers:  # Adam's state must exist to be saved
        optimizer._init_optimizer_states_with_dummy_values()
    with pytest.raises(OptimizerCheckpointFormatUnsupported, match="--dist-ckpt-optim-fully-reshardable"):
        ours.save(directory, fully_reshardable=False)
    for optimizer in stock.optimizer.chained_optimizers:
        optimizer._init_optimizer_states_with_dummy_values()
    stock.save(directory, fully_reshardable=False)
    with pytest.raises(OptimizerCheckpointFormatUnsupported, match="--dist-ckpt-optim-fully-reshardable"):
        ours.load(directory)
    check_optimizer_checkpoint_format(save_metadata(fully_reshardable=True))
    fixed = os.path.join(directory, "fixed")
    ours.save(fixed, fully_reshardable=True)
    check_optimizer_checkpoint_format(dist_checkpointing.load_content_metadata(fixed))
    stock.load(fixed)
    differing = _differing(ours.optimizer_state(), stock.optimizer_state())
    assert not differing, f"fully reshardable: state differs after load: {differing[:6]} of {len(differing)}"


# --- through Megatron's training loop: save_checkpoint / load_checkpoint (megatron_checkpointing) --

FULLY_RESHARDABLE = "--dist-ckpt-optim-fully-reshardable"  # what the launch asks of FP8 experts
# FP8 experts loading the optimizer state of a checkpoint in Megatron's default format, and a run
# whose own saves would use that format.
LOAD_REFUSAL = (
    "--moe-fp4-experts fp8 cannot load the distributed optimizer's state from a 'dp_reshardable' checkpoint "
    "(stored in parameter order, which differs from Megatron's grouped experts): add --no-load-optim or "
    "--finetune to load its weights only, or resume it once without --moe-fp4-experts fp8 and with "
    "--dist-ckpt-optim-fully-reshardable and load the checkpoint that run saves.")
SAVE_REFUSAL = (
    "--moe-fp4-experts fp8 cannot save or load the distributed optimizer's 'dp_reshardable' checkpoint "
    "format (optimizer state stored in parameter order, which differs from Megatron's grouped experts); "
    "add --dist-ckpt-optim-fully-reshardable.")


def _load(run, flags: list):
    """Megatron's load_checkpoint into `run` under `flags`: the iteration it resumes from, or the
    sentence a refusal raised (on both ranks alike)."""
    from support import megatron_checkpointing

    megatron_checkpointing.use_arguments(flags)
    try:
        return megatron_checkpointing.load(run)
    except ValueError as refusal:  # UnsupportedConfiguration is one
        return str(refusal)


def _save(run, iteration: int, flags: list) -> dict:
    """Megatron's save_checkpoint of `run` under `flags` (with --save); what it saved, layout-free."""
    from support import megatron_checkpointing

    megatron_checkpointing.use_arguments(flags)
    megatron_checkpointing.save(run, iteration)
    return megatron_checkpointing.layout_free_state(run)


def _loaded(run, flags: list, saved: dict, iteration: int, weights_only: bool = False) -> list:
    """Load into `run` (a fresh init, so nothing matches by chance) and compare with `saved` bit
    for bit: everything, or with `weights_only` the weights and the fp32 main weights, which must
    then be made from them. The problems."""
    from support.megatron_checkpointing import differing, layout_free_state

    expected = saved
    if weights_only:
        weights = {k: v for k, v in saved.items() if k[1] == "weight"}
        expected = {**weights, **{(name, "param"): weight.float() for (name, _), weight in weights.items()}}
    before = layout_free_state(run)
    unchanged = [k for k in expected if "experts" in k[0] and k[1] == "weight"
                 and not differing({k: expected[k]}, {k: before[k]})]
    got = _load(run, flags)
    if got != iteration:
        return [f"{flags}: got {got!r}, not iteration {iteration}"]
    state = layout_free_state(run)
    lost = differing(expected, {k: state[k] for k in expected if k in state})
    return ([f"{flags}: {len(lost)} of {len(expected)} tensors differ from the saved ones: {lost[:4]}"] if lost
            else []) + ([f"the loader's init already held the saved {unchanged[:2]}"] if unchanged else [])


def stock_checkpoint(directory: str) -> dict:
    """Finding 10: a stock BF16 run saved in Megatron's default optimizer format. FP8 experts (the
    whole recipe) take its weights with --finetune or --no-load-optim, refuse its optimizer state in
    one sentence, and take the state too once a stock resume has re-saved it fully reshardable
    (the refusal's advice)."""
    stock = Run(plugin=False, seed=1)
    stock.step(0)
    default = os.path.join(directory, "default")
    saved = _save(stock, 1, ["--save", default])
    problems = {"weights_only": [], "optimizer_refused": [], "resave_carries_optimizer": []}
    for seed, (flag, iteration) in enumerate((("--finetune", 0), ("--no-load-optim", 1)), start=2):
        problems["weights_only"] += _loaded(Run(plugin=True, seed=seed), [
            "--load", default, flag, FULLY_RESHARDABLE, "--save", directory], saved, iteration, weights_only=True)
    for flags, sentence in ((["--load", default, FULLY_RESHARDABLE], LOAD_REFUSAL),
                            (["--load", default, "--finetune", "--save", directory], SAVE_REFUSAL)):
        got = _load(Run(plugin=True, seed=4), flags)
        if got != sentence:
            problems["optimizer_refused"].append(f"{flags}: {got!r}")
    # The advice: resume once without FP8 experts, saving fully reshardable; then everything loads.
    resaved = os.path.join(directory, "resaved")
    restock = Run(plugin=False, seed=5)
    got = _load(restock, ["--load", default, FULLY_RESHARDABLE])
    _save(restock, 1, ["--save", resaved, FULLY_RESHARDABLE])
    problems["resave_carries_optimizer"] += [f"the stock resume got {got!r}"] if got != 1 else []
    problems["resave_carries_optimizer"] += _loaded(Run(plugin=True, seed=6), ["--load", resaved, FULLY_RESHARDABLE],
                                                    saved, 1)
    return problems


def _expert_parallel(size: int) -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=size, expert_tensor_parallel_size=1)


def _megatron_error(run, flags: list) -> str:
    from support import megatron_checkpointing

    megatron_checkpointing.use_arguments(flags)
    try:
        return f"loaded iteration {megatron_checkpointing.load(run)}"
    except Exception as error:  # noqa: BLE001 - what Megatron raises is the finding
        return f"{type(error).__name__}: {error}"


# Megatron 0.19 builds one optimizer at EP 1 (ETP = TP: expert weights reduced like dense ones) and
# a chained pair (dense, experts) at EP > 1; its load_checkpoint cannot map the optimizer state of
# one onto the other, stock experts as ours (measured with both).
EP_OPTIMIZER_ERRORS = {(2, 1): "KeyError: 'optimizer'",
                       (1, 2): "RuntimeError: Expected 2 entries in state dict, but got 4."}


def flag_and_layout_changes(directory: str) -> dict:
    """A run with FP4 dispatch only (BF16 experts) saves; FP8 experts resume from it (state bit for
    bit, the next loss within the recipe's rounding of the dispatch-only run's), except from
    Megatron's default format (refused in one sentence). They train a step and save at EP 2; EP 1
    loads that, saves, and EP 2 loads that: weights and fp32 main weights bit for bit (experts by
    global index) with --no-load-optim, the optimizer state being what Megatron cannot move between
    EP 1 and EP 2 (EP_OPTIMIZER_ERRORS, checked)."""
    dispatch = Run(plugin="dispatch", seed=1)
    dispatch.step(0)
    at_ep2, default = os.path.join(directory, "dispatch"), os.path.join(directory, "dispatch_default")
    saved = _save(dispatch, 1, ["--save", at_ep2, FULLY_RESHARDABLE])
    _save(dispatch, 1, ["--save", default])
    continued = dispatch.step(1)
    problems = {"dispatch_then_fp8_experts": [], "ep2_to_ep1": [], "ep1_to_ep2": []}
    fp8 = Run(plugin="dispatch, fp8 experts", seed=2)
    got = _load(fp8, ["--load", default, FULLY_RESHARDABLE])
    if got != LOAD_REFUSAL:
        problems["dispatch_then_fp8_experts"].append(f"from the default format: {got!r}")
    problems["dispatch_then_fp8_experts"] += _loaded(fp8, ["--load", at_ep2, FULLY_RESHARDABLE], saved, 1)
    resumed = fp8.step(1)
    log(f"after the resume: dispatch only {continued.item()}, with FP8 experts {resumed.item()}")
    if not (resumed - continued).abs() <= FP8_EXPERTS_FIRST_STEP_BOUND:
        problems["dispatch_then_fp8_experts"].append(f"loss after the resume {resumed.item()} vs {continued.item()}")
    fp8_at_ep2, fp8_at_ep1 = os.path.join(directory, "fp8_ep2"), os.path.join(directory, "fp8_ep1")
    saved = _save(fp8, 2, ["--save", fp8_at_ep2, FULLY_RESHARDABLE])
    for (source, target), checkpoint, case in (((2, 1), fp8_at_ep2, "ep2_to_ep1"), ((1, 2), fp8_at_ep1, "ep1_to_ep2")):
        _expert_parallel(target)
        error = _megatron_error(Run(plugin="dispatch, fp8 experts", seed=3, ep=target),
                                ["--load", checkpoint, FULLY_RESHARDABLE])
        if error != EP_OPTIMIZER_ERRORS[source, target]:
            problems[case].append(f"with the optimizer state, Megatron's load now gives {error!r} (was "
                                  f"{EP_OPTIMIZER_ERRORS[source, target]!r}): test that it carries the state")
        loader = Run(plugin="dispatch, fp8 experts", seed=4 + target, ep=target)
        problems[case] += _loaded(loader, ["--load", checkpoint, "--no-load-optim", FULLY_RESHARDABLE], saved, 2,
                                  weights_only=True)
        if target == 1:  # and back: the weights as EP 1 saves them (with an Adam state, as a run has)
            for optimizer in loader.optimizer.chained_optimizers:
                optimizer._init_optimizer_states_with_dummy_values()
            saved = _save(loader, 2, ["--save", fp8_at_ep1, FULLY_RESHARDABLE])
    return problems


def formats_and_moves(results: str, directory: str) -> None:
    """bucket_format, stock_checkpoint and flag_and_layout_changes in one process pair (Megatron's
    start-up once); writes this rank's problems by case, as JSON, to results/rank<R>.json."""
    from support import megatron_checkpointing

    problems, start = {}, time.monotonic()
    try:
        bucket_format(os.path.join(directory, "bucket_format"))
        problems["bucket_format"] = []
    except (AssertionError, pytest.fail.Exception) as error:
        problems["bucket_format"] = [str(error)]
    try:
        for scenario in (stock_checkpoint, flag_and_layout_changes):
            log(f"{time.monotonic() - start:.1f} s in: {scenario.__name__}")
            problems.update(scenario(os.path.join(directory, scenario.__name__)))
    finally:
        megatron_checkpointing.forget_arguments()
    log(f"{time.monotonic() - start:.1f} s in: done")
    with open(os.path.join(results, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(problems, f)


SCENARIOS = {"cross_load": cross_load, "plugin_saver": plugin_saver, "bucket_format": bucket_format,
             "formats_and_moves": formats_and_moves}


def run(rank: int, scratch: str, name: str, *arguments) -> None:
    """Run scenario `name` on this rank (two gloo ranks, torch.cuda emulated), EP 2."""
    from megatron.core import parallel_state

    from support import megatron_training_on_cpu

    megatron_training_on_cpu.install()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    try:
        SCENARIOS[name](*arguments, os.path.join(scratch, "checkpoint"))
    finally:
        parallel_state.destroy_model_parallel()
