"""benchmarks/ab_grouped_gemm.py: the baseline file (a copy of kernels/grouped_gemm_triton.py) loads as
its own module of megatron_fp4.kernels and computes what this checkout computes (here: this
checkout's own file as the baseline, under the interpreter on CPU); a missing, broken or foreign
baseline file is refused with its reason."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import ab_grouped_gemm as ab
from megatron_fp4 import kernels as K
from megatron_fp4.kernels import GemmBackend, grouped_gemm_triton

COUNTS = [130, 0, 3, 70]


def test_the_baseline_is_a_module_of_its_own_with_the_same_sums(device):
    """The A/B's calls of this checkout's own Triton module, loaded as the baseline, give the bits of
    the front door's Triton backend at the default tiles (forward and weight gradient)."""
    baseline = ab.load_baseline(Path(grouped_gemm_triton.__file__))
    assert baseline is not grouped_gemm_triton and baseline.__name__ == ab.BASELINE_MODULE
    assert baseline.launch_rows is not grouped_gemm_triton.launch_rows
    g = torch.Generator().manual_seed(0)
    rows = K.quantize_fp8_rows(torch.randn(sum(COUNTS), 256, generator=g).bfloat16().to(device))
    weights = K.quantize_fp8_weights_stacked(list((torch.randn(len(COUNTS), 128, 256, generator=g) * 0.02)
                                                  .bfloat16().to(device)))
    offsets = F.pad(torch.tensor(COUNTS).cumsum(0), (1, 0)).to(device)
    ours = K.grouped_gemm_by_weight(rows, weights, offsets, backend=GemmBackend.TRITON)
    assert torch.equal(ab.rows_call(baseline, rows, weights, offsets)().view(torch.int16), ours.view(torch.int16))
    counts = torch.tensor(COUNTS, device=device)
    grad_cols, x_cols = (K.quantize_fp8_cols(torch.randn(sum(COUNTS), width, generator=g).bfloat16().to(device), counts)
                         for width in (128, 256))
    ours = K.grouped_wgrad(grad_cols, x_cols, backend=GemmBackend.TRITON)
    assert torch.equal(ab.wgrad_call(baseline, grad_cols, x_cols)().view(torch.int16), ours.view(torch.int16))


def test_unusable_baselines_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="--baseline .* is not a file"):
        ab.load_baseline(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("from ._no_such_helper import anything\n")
    with pytest.raises(SystemExit, match="does not load against this checkout: ModuleNotFoundError"):
        ab.load_baseline(broken)
    foreign = tmp_path / "foreign.py"
    foreign.write_text("def launch_rows():\n    pass\n")
    with pytest.raises(SystemExit, match="lacks launch_wgrad, DEFAULT_ROWS_TILES, DEFAULT_WGRAD_TILES"):
        ab.load_baseline(foreign)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_refuses_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["--baseline", str(tmp_path / "x.py"), "--baseline-commit", "abc"])
