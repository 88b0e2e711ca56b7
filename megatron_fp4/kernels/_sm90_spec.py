"""What each kernel file declares for the ahead-of-time SM90 build check (sm90_build.py): its
kernels' compile signatures, next to the kernels, so a changed parameter list is changed once."""

from dataclasses import dataclass
from typing import Dict

# The column kernels are compiled for up to 32 local experts (their EXPERTS_POW2).
EXPERTS_POW2 = 32


@dataclass(frozen=True)
class BuildVariant:
    """One configuration the check compiles every kernel in."""

    hidden: int
    ceil_rule: bool  # the MXFP4 scale rule "ceil" (else "floor")
    input_kind: int  # _checks.float_kind of the float input: 0 bf16, 1 fp16, 2 fp32

    @property
    def pairs_pointer(self) -> str:
        """Pointer type of an input read as element pairs (_checks.pair_view)."""
        return "*i64" if self.input_kind == 2 else "*i32"


@dataclass(frozen=True)
class KernelSpec:
    name: str
    fn: object  # the @triton.jit function
    signature: Dict[str, str]  # runtime arguments; every other parameter is a constexpr
    constexprs: Dict[str, object]
    num_warps: int
    elements_per_program: int
    num_stages: int = 3  # Triton's default for CUDA; the GEMMs pass their tiles' stages

    @classmethod
    def tiled(cls, name: str, fn, signature: Dict[str, str], constexprs: Dict[str, object], config,
              tile_cols: str, elements_per_col: int) -> "KernelSpec":
        """A kernel launched with a _checks.TileConfig: BLOCK_ROWS and the constexpr named tile_cols
        take its tile, elements_per_col elements per unit of its block_cols."""
        constexprs = dict(constexprs, BLOCK_ROWS=config.block_rows, **{tile_cols: config.block_cols})
        return cls(name, fn, signature, constexprs, config.num_warps,
                   config.block_rows * config.block_cols * elements_per_col)
