"""kernels/tile_choice.py: the fastest candidate is timed once per GEMM shape and kept; one candidate is
never timed; inside a CUDA graph capture the first candidate runs untimed and nothing is kept; and
grouped_gemm_by_weight's candidates (both kernels on SM90, the Triton kernel elsewhere)."""

import torch

from megatron_fp4.kernels import grouped_gemm_sm90
from megatron_fp4.kernels.grouped_fp8_gemm import (CUDA_ROWS_TILES, CUDA_WIDE_TILES, DEFAULT_ROWS_TILES,
                                                   rows_gemm_candidates)
from megatron_fp4.kernels.tile_choice import GemmShape, TileChoices

CPU = torch.device("cpu")


def _shape(rows=1000, n=256, experts=4):
    return GemmShape.of("gemm", CPU, rows, n, 512, experts, torch.bfloat16)


def _choices(milliseconds):
    """TileChoices whose timer reads each candidate's time from `milliseconds` after running it; the
    runs made, in order."""
    runs = []

    def timer(run):
        return milliseconds[run()]

    def run(tiles):
        runs.append(tiles)
        return tiles

    return TileChoices(timer), run, runs


def test_the_fastest_is_timed_once_and_kept_per_shape():
    choices, run, runs = _choices({"a": 2.0, "b": 1.0, "c": 3.0})
    assert choices.fastest(_shape(), ["a", "b", "c"], run) == "b"
    assert runs == ["a", "b", "c"]
    assert choices.fastest(_shape(), ["a", "b", "c"], run) == "b"
    assert runs == ["a", "b", "c"]  # kept: not timed again
    assert choices.fastest(_shape(rows=1020), ["a", "b", "c"], run) == "b"  # 1000 and 1020 round up to 1024
    assert len(runs) == 3
    choices.fastest(_shape(experts=8), ["a", "b", "c"], run)  # another shape: timed
    assert len(runs) == 6
    assert set(choices.chosen()) == {_shape(), _shape(experts=8)}
    assert _shape(rows=1025) != _shape() and _shape(rows=0).rows_bucket == 1


def test_one_candidate_is_not_timed():
    choices, run, runs = _choices({"a": 1.0})
    assert choices.fastest(_shape(), ["a"], run) == "a"
    assert runs == [] and choices.chosen() == {}


def test_inside_a_graph_capture_the_first_candidate_runs_untimed(monkeypatch):
    choices, run, runs = _choices({"a": 2.0, "b": 1.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert choices.fastest(_shape(), ["a", "b"], run) == "a"
    assert runs == [] and choices.chosen() == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert choices.fastest(_shape(), ["a", "b"], run) == "b"


def test_the_rows_gemm_candidates(monkeypatch):
    """On SM90 the CUDA kernel's default tiles first, then the Triton kernel's; elsewhere the Triton
    kernel's alone (nothing to time)."""
    gpu = torch.device("cuda")
    monkeypatch.setattr(grouped_gemm_sm90, "_capability", lambda device: (9, 0))
    assert rows_gemm_candidates(gpu, (4096, 7168)) == [CUDA_WIDE_TILES, DEFAULT_ROWS_TILES]
    assert rows_gemm_candidates(gpu, (7168, 2048)) == [CUDA_ROWS_TILES, DEFAULT_ROWS_TILES]
    assert rows_gemm_candidates(CPU, (4096, 7168)) == [DEFAULT_ROWS_TILES]
    monkeypatch.setattr(grouped_gemm_sm90, "_capability", lambda device: (10, 0))
    assert rows_gemm_candidates(gpu, (4096, 7168)) == [DEFAULT_ROWS_TILES]
