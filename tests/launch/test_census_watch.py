"""The start-up census (megatron_fp4.launch.census_watch) in process, on CPU, with stand-in modules
that are Megatron's classes without their construction (isinstance is all the census asks): layers
held outside a GPT decoder block (as a hybrid stack holds them) are counted, a forward pass before
any layer exists leaves the watch on, and a stock MoE layer where the flags ask for ours stops the
run at the first forward pass. The census over real models: tests/launch/test_user_pretrain_gpt.py."""

import pytest
import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_fp4.launch import census_watch
from megatron_fp4.options import FP4Options


def _bare(cls):
    """An instance of a Megatron module class with only torch.nn.Module's state."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    return module


def test_a_stock_moe_layer_outside_a_decoder_block_stops_the_run(capsys):
    census_watch.watch(FP4Options(dispatch=True))
    torch.nn.Identity()(torch.zeros(1))  # a forward before any layer is built
    assert census_watch._watch is not None

    stack = torch.nn.Module()  # holds its layers itself, as Megatron's HybridStack does
    layer = _bare(TransformerLayer)
    layer.mlp = _bare(MoELayer)
    layer.mlp.experts = torch.nn.Identity()
    stack.layers = torch.nn.ModuleList([layer])
    with pytest.raises(SystemExit) as stop:
        torch.nn.Identity()(torch.zeros(1))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: --moe-fp4-dispatch asks for MoE layers dispatching in MXFP4, and the model on this rank has 0 of 1:")
    assert census_watch._watch is None  # the hooks are gone


def test_nothing_is_watched_without_our_flags():
    census_watch.watch(FP4Options())
    assert census_watch._watch is None


def test_the_census_counts_experts_recomputed_alone():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_fp4.experts.recomputed import experts_recomputed
    from megatron_fp4.integration.census import census_line, shortfall, take_census

    options = FP4Options(recompute_experts=True)
    model = torch.nn.Module()
    layers = [_bare(TransformerLayer) for _ in range(2)]
    for layer, experts in zip(layers, (experts_recomputed(SequentialMLP), SequentialMLP)):
        layer.mlp = _bare(MoELayer)
        layer.mlp.experts = _bare(experts)
    model.layers = torch.nn.ModuleList(layers)
    census = take_census([model], options)
    assert census_line(census, options) == (
        "megatron_fp4: 1 of 2 MoE layers' experts recomputed from their dispatched input")
    assert shortfall(census, options).startswith(
        "--moe-fp4-recompute-experts asks for experts recomputed alone, and the model on this rank has 1 of 2:")
