"""`megatron-fp4 estimate --plot`: the bars are the table's columns (device-level rows stacked last),
and the paths it refuses before estimating."""

import os
import sys
from pathlib import Path

import pytest

from megatron_fp4.estimator import GIB, estimate

from test_estimator import PROXY, _main


def test_plot_bars_are_the_tables_columns():
    from megatron_fp4.estimator.plot import PARTS, bar_of

    for name in ("memcap_bf16_attn", "memcap_bf16_attn_moe"):
        e = estimate(PROXY / f"{name}.yaml")
        bar = bar_of(e)
        r = e.peak_rank
        assert list(bar.parts) == [part for part, _ in PARTS]
        assert bar.parts["optimizer"] == r.static.optimizer / GIB
        assert bar.parts["transient"] == (r.transient + r.static.buffers) / GIB  # as the table's column
        assert bar.parts["device"] == e.device.total / GIB  # the device-level rows, stacked last
        assert bar.peak_gib == pytest.approx(e.device_peak_gib)
        assert (bar.capacity_gib, bar.fits) == (e.gpu_memory_gib, e.fits)
        assert bar.label.startswith(f"proxy/{name}.yaml\nbf16, recompute core_attn")


def _png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_cli_plots_the_configs_against_the_gpu_memory(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("the test extra installs matplotlib")  # a broken install, not a skip
        pytest.skip("matplotlib is not installed (pip install 'megatron_fp4[plot]')")
    path = tmp_path / "memcap.png"
    configs = [str(PROXY / f"memcap_{name}.yaml") for name in ("bf16_attn", "bf16_attn_moe", "fp4_attn")]
    assert _main(["estimate", "--plot", str(path), *configs]) == 0
    out = capsys.readouterr().out
    assert f"plot: {path}" in out and "memcap_fp4_attn.yaml" in out  # the table too
    width, height = _png_size(path)
    assert width > 1000 and height > 500  # four bars (two for the fp4 config), legend, labels


def test_cli_plot_without_matplotlib_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = tmp_path / "none.png"
    assert _main(["estimate", "--plot", str(path), str(PROXY / "memcap_bf16_attn.yaml")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not path.exists()
    assert captured.err == "error: --plot needs matplotlib: pip install 'megatron_fp4[plot]' (or matplotlib)\n"


@pytest.mark.parametrize("name, sentence", [
    ("missing/memory.png", "error: --plot {path}: the folder {parent} does not exist\n"),
    ("memory.txt", "error: --plot {path}: the file name must end in a format matplotlib writes ({formats}), not "
                   "'.txt'\n"),
    ("memory", "error: --plot {path}: the file name must end in a format matplotlib writes ({formats}), and it has "
               "none\n"),
    ("memory.pgf", "error: --plot {path}: the file name must end in a format matplotlib writes ({formats}), not "
                   "'.pgf'\n"),  # matplotlib lists it, but it runs LaTeX
    ("", "error: --plot {path} is a folder: name a file in it, such as {path}/memory.png\n"),
])
def test_cli_plot_refuses_a_path_it_cannot_write_before_estimating(tmp_path, capsys, monkeypatch, name, sentence):
    """A missing folder or a suffix matplotlib does not write ended in matplotlib's traceback, after
    the estimates."""
    pytest.importorskip("matplotlib")
    from megatron_fp4.estimator import cli

    monkeypatch.setattr(cli, "estimate", lambda *a, **k: pytest.fail("estimated before refusing the --plot path"))
    path = tmp_path / name if name else tmp_path
    assert _main(["estimate", "--plot", str(path), str(PROXY / "memcap_bf16_attn.yaml")]) == 2
    captured = capsys.readouterr()
    from megatron_fp4.estimator.plot import plot_formats

    formats = ", ".join("." + f for f in plot_formats())
    assert captured.out == "" and captured.err == sentence.format(path=path, parent=path.parent, formats=formats)
    assert ".png" in formats and ".svg" in formats and ".pdf" in formats and ".pgf" not in formats
    assert not (tmp_path / "missing").exists()


def test_cli_plot_takes_any_suffix_case(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.SVG"
    assert _main(["estimate", "--plot", str(path), str(PROXY / "memcap_bf16_attn.yaml")]) == 0
    assert path.read_bytes().lstrip().startswith(b"<?xml") and f"plot: {path}" in capsys.readouterr().out
