"""What production code may not lean on, and how its floors stack. It never imports the reference
oracle: megatron_fp4.reference is the tests' truth, and a kernel or module that leaned on it would be
checked against itself. The imports are layered: kernels/ imports none of the packages built on it
(experts/, linears/, dispatch/, fp8/), fp8/ (what experts and linears share) neither of those two,
linears/ not experts/; and no module imports another package's private name (a `_`-prefixed name or
module of a different subpackage of megatron_fp4; benchmarks/ count as another package). All read
with `ast`, so an import inside a function, a relative import or importlib.import_module("...")
counts too. And production code holds no CPU emulation: the FP8 GEMMs refuse CPU operands unless a
test installs one (tests/support)."""

import ast
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_fp4"
BENCHMARKS = PACKAGE.parent / "benchmarks"
ORACLE = "megatron_fp4.reference"
# subpackage -> the subpackages it may not import (those built on it).
BUILT_ON = {
    "kernels": {"experts", "linears", "dispatch", "fp8"},
    "fp8": {"experts", "linears"},
    "linears": {"experts"},
}


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


def imports(source: str, package: str):
    """(module, name) of every import the source may make, anywhere in it (functions, branches
    included): name None for a module imported as a whole, else the name taken from the module (a
    name defined there, or its submodule)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.module or "", node.level)
            yield from ((base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.args[0].value
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(name, str):
                dots = len(name) - len(name.lstrip("."))
                yield _resolve(package, name[dots:], dots), None


def imported_modules(source: str, package: str):
    """Every module name the source may import (a name taken from a module may be its submodule)."""
    for module, name in imports(source, package):
        yield module
        if name is not None:
            yield f"{module}.{name}"


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


def _subpackage(module: str) -> str:
    """The subpackage of megatron_fp4 a module belongs to ("" for the package's own top-level modules);
    None outside megatron_fp4."""
    parts = module.split(".")
    if parts[0] != "megatron_fp4":
        return None
    if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return ""


def upward_imports(module: str, source: str, package: str):
    """The imports of `module` (its source, its package) of a subpackage built on its own (BUILT_ON)."""
    forbidden = BUILT_ON.get(_subpackage(module), set())
    return sorted({name for name in imported_modules(source, package) if _subpackage(name) in forbidden})


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _owner(module: str, name) -> str:
    """The subpackage of megatron_fp4 whose private thing `from module import name` (or `import module`)
    takes, or None where it takes nothing private of megatron_fp4."""
    if _subpackage(module) is None:
        return None
    parts = module.split(".") + ([name] if name is not None else [])
    for i, part in enumerate(parts[1:], start=1):
        if _is_private(part):
            return _subpackage(".".join(parts[:i]) if i > 1 else "megatron_fp4")
    return None


def private_imports(importer_subpackage, source: str, package: str):
    """`module.name` of each private name or module of another subpackage the source imports
    (importer_subpackage: its own, "" for the top-level modules, None outside megatron_fp4)."""
    taken = []
    for module, name in imports(source, package):
        owner = _owner(module, name)
        if owner is not None and owner != importer_subpackage:
            taken.append(module if name is None else f"{module}.{name}")
    return sorted(set(taken))


def _sources():
    """(module name, its package, importer subpackage, path) of every Python file of megatron_fp4 and benchmarks/."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield _module_name(path), _package_of(path), _subpackage(_module_name(path)), path
    for path in sorted(BENCHMARKS.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        yield name, name.rpartition(".")[0] if path.name != "__init__.py" else name, None, path


def test_no_package_imports_one_built_on_it():
    offenders = []
    for module, package, subpackage, path in _sources():
        if subpackage is not None:
            offenders += [f"{path.relative_to(PACKAGE.parent)} imports {name}"
                          for name in upward_imports(module, path.read_text(), package)]
    assert not offenders, ("kernels/ imports none of experts, linears, dispatch, fp8; fp8/ neither experts nor "
                           "linears; linears/ not experts:\n" + "\n".join(offenders))


def test_no_module_imports_another_packages_private_name():
    offenders = []
    for _, package, subpackage, path in _sources():
        offenders += [f"{path.relative_to(PACKAGE.parent)} imports {name}"
                      for name in private_imports(subpackage, path.read_text(), package)]
    assert not offenders, ("a `_`-prefixed name or module is its subpackage's own: expose a public name or move the "
                           "user:\n" + "\n".join(offenders))


def test_the_layering_checks_see_violations():
    """Each rule flags a source that breaks it, in every form an import takes, and passes what it allows."""
    kernels, experts, linears, fp8 = ("megatron_fp4." + p for p in ("kernels", "experts", "linears", "fp8"))
    up = {"from ..experts import swiglu": kernels, "def f():\n    from ..linears.module import saved_input\n": kernels,
          "import megatron_fp4.dispatch.wire": kernels, "from .. import fp8": kernels,
          "importlib.import_module('megatron_fp4.experts.module')": kernels,
          "from ..experts.module import FP8Experts": linears, "from ..linears import SavedInput": fp8}
    for source, package in up.items():
        assert upward_imports(package + ".m", source, package), source
    allowed = {"from ._bits import store_rounded": kernels, "from ..formats import FP8_BLOCK": kernels,
               "from ..fp8 import segment_products": linears, "from ..kernels import swiglu": experts,
               "from ..linears import SavedInput": experts}
    for source, package in allowed.items():
        assert not upward_imports(package + ".m", source, package), source

    private = {"from ..kernels._bits import store_rounded": ("experts", experts),
               "from ..kernels.mxfp4_quantize import _e2m1_code": ("experts", experts),
               "from ..kernels import _checks": ("linears", linears),
               "import megatron_fp4.kernels._checks": ("fp8", fp8),
               "def f():\n    from megatron_fp4.run_config import _check_flag\n": ("estimator",
                                                                                 "megatron_fp4.estimator"),
               "importlib.import_module('megatron_fp4.kernels._segments')": (None, "benchmarks"),
               "from megatron_fp4.fp8.gemm import _scaled_mm": (None, "benchmarks")}
    for source, (importer, package) in private.items():
        assert private_imports(importer, source, package), source
    own = {"from ._bits import store_rounded": ("kernels", kernels),
           "from .mxfp4_quantize import _e2m1_code": ("kernels", kernels),
           "from .run_config import _check_flag": ("", "megatron_fp4"),
           "from ..kernels import swiglu, __all__": ("experts", experts), "import torch._C": ("fp8", fp8)}
    for source, (importer, package) in own.items():
        assert not private_imports(importer, source, package), source


def test_fp8_gemms_refuse_cpu_operands_without_the_test_emulation(monkeypatch):
    from megatron_fp4 import reference as ref
    from megatron_fp4.fp8 import gemm

    monkeypatch.setattr(gemm, "scaled_mm_off_cuda", None)
    x = ref.quantize_fp8_rows(torch.randn(4, 256))
    w = ref.quantize_fp8_weight(torch.randn(128, 256))
    with pytest.raises(RuntimeError, match=r"^the FP8 expert GEMMs need an SM90 \(Hopper\) GPU; the operands are on cpu$"):
        gemm.gemm_by_weight(x.data, x.block_scales.t(), w)
    x_t, grad_t = (ref.quantize_fp8_cols(torch.randn(256, 256), [256]) for _ in range(2))
    with pytest.raises(RuntimeError, match="need an SM90"):
        gemm.gemm_1x128(*gemm.columns_segment(x_t, 0, 256), *gemm.columns_segment_as_b(grad_t, 0, 256))
