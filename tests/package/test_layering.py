"""What production code may not lean on. It never imports the reference oracle:
megatron_fp4.reference is the tests' truth, and a kernel or module that leaned on it would be
checked against itself (read with `ast`, so an import inside a function, a relative import or
importlib.import_module("...") counts too). And it holds no CPU emulation: the FP8 GEMMs refuse
CPU operands unless a test installs one (tests/support)."""

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_fp4"
ORACLE = "megatron_fp4.reference"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(package: str, module: str, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` inside `package`."""
    if level == 0:
        return module
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_modules(source: str, package: str):
    """Every module name the source may import, anywhere in it (functions, branches included)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.module or "", node.level)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(name, str):
                dots = len(name) - len(name.lstrip("."))
                yield _resolve(package, name[dots:], dots)


def _is_oracle(name: str) -> bool:
    return name == ORACLE or name.startswith(ORACLE + ".")


def test_no_production_module_imports_the_reference():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _module_name(path) == ORACLE:
            continue
        names = imported_modules(path.read_text(), _package_of(path))
        offenders += [f"{path.relative_to(PACKAGE.parent)} imports {n}" for n in names if _is_oracle(n)]
    assert not offenders, "production code must not import the reference oracle:\n" + "\n".join(offenders)


def test_the_import_check_sees_lazy_and_relative_imports():
    lazy = "def f():\n    from ..reference import colwise_capacity\n"
    assert any(_is_oracle(n) for n in imported_modules(lazy, "megatron_fp4.kernels"))
    assert any(_is_oracle(n) for n in imported_modules("from . import reference", "megatron_fp4"))
    assert any(_is_oracle(n) for n in imported_modules("import megatron_fp4.reference as r", "megatron_fp4.x"))
    dynamic = "importlib.import_module('megatron_fp4.reference')"
    assert any(_is_oracle(n) for n in imported_modules(dynamic, "megatron_fp4"))
    assert not any(_is_oracle(n) for n in imported_modules("from ..layout import colwise_capacity",
                                                             "megatron_fp4.kernels"))


def test_fp8_gemms_refuse_cpu_operands_without_the_test_emulation(monkeypatch):
    from megatron_fp4 import reference as ref
    from megatron_fp4.experts import gemm

    monkeypatch.setattr(gemm, "scaled_mm_off_cuda", None)
    x = ref.quantize_fp8_rows(torch.randn(4, 256))
    w = ref.quantize_fp8_weight(torch.randn(128, 256))
    with pytest.raises(RuntimeError, match=r"^the FP8 expert GEMMs need an SM90 \(Hopper\) GPU; the operands are on cpu$"):
        gemm.gemm_by_weight(x.data, x.block_scales.t(), w)
    x_t, grad_t = (ref.quantize_fp8_cols(torch.randn(256, 256), [256]) for _ in range(2))
    with pytest.raises(RuntimeError, match="need an SM90"):
        gemm.gemm_1x128(*gemm.columns_segment(x_t, 0, 256), *gemm.columns_segment_as_b(grad_t, 0, 256))
