"""benchmarks/ab_grouped_gemm.py: the baseline file loads as its own module of megatron_fp4.kernels
and computes what this checkout computes (here: this checkout's own file as the baseline, under the
interpreter on CPU); a missing, broken or foreign baseline file is refused with its reason."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import ab_grouped_gemm as ab
from megatron_fp4 import kernels as K
from megatron_fp4.kernels import GemmTiles
from megatron_fp4.kernels import grouped_fp8_gemm

COUNTS = [130, 0, 3, 70]
TILES = GemmTiles(block_m=128, block_n=128, num_warps=4, num_stages=2, row_halves=2)


def test_the_baseline_is_a_module_of_its_own_with_the_same_sums(device):
    baseline = ab.load_baseline(Path(grouped_fp8_gemm.__file__))
    assert baseline is not grouped_fp8_gemm and baseline.__name__ == ab.BASELINE_MODULE
    assert baseline.grouped_gemm_by_weight is not grouped_fp8_gemm.grouped_gemm_by_weight
    g = torch.Generator().manual_seed(0)
    rows = K.quantize_fp8_rows(torch.randn(sum(COUNTS), 256, generator=g).bfloat16().to(device))
    weights = K.quantize_fp8_weights_stacked(list((torch.randn(len(COUNTS), 128, 256, generator=g) * 0.02)
                                                  .bfloat16().to(device)))
    offsets = F.pad(torch.tensor(COUNTS).cumsum(0), (1, 0)).to(device)
    ours = grouped_fp8_gemm.grouped_gemm_by_weight(rows, weights, offsets, tiles=TILES)
    assert torch.equal(baseline.grouped_gemm_by_weight(rows, weights, offsets, tiles=TILES).view(torch.int16),
                       ours.view(torch.int16))


def test_unusable_baselines_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--baseline .* is not a file"):
        ab.load_baseline(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("from ._no_such_helper import anything\n")
    with pytest.raises(SystemExit, match="does not load against this checkout: ModuleNotFoundError"):
        ab.load_baseline(broken)
    foreign = tmp_path / "foreign.py"
    foreign.write_text("def grouped_gemm_by_weight():\n    pass\n")
    with pytest.raises(SystemExit, match="lacks grouped_wgrad, DEFAULT_ROWS_TILES, DEFAULT_WGRAD_TILES"):
        ab.load_baseline(foreign)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_refuses_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["--baseline", str(tmp_path / "x.py"), "--baseline-commit", "abc"])
