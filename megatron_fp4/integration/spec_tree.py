"""Rewriting Megatron layer specs without touching the originals.

Specs are trees of ModuleSpecs, functools.partials (0.19 builds MoE layers and experts as
partial(Class, submodules=...)), dataclasses (MoESubmodules, TransformerBlockSubmodules, ...),
lists and tuples. `rewrite_spec` copies every such node, children first, and hands each copy to
`rewrite`, which may change it in place or return a replacement; other objects (classes,
functions, numbers) are shared, not copied.
"""

import copy
import dataclasses
import functools
from typing import Any, Callable

from megatron.core.transformer.spec_utils import ModuleSpec


def rewrite_spec(node: Any, rewrite: Callable[[Any], Any], seen: dict = None) -> Any:
    seen = {} if seen is None else seen
    if id(node) in seen:
        return seen[id(node)]
    if isinstance(node, functools.partial):
        args = tuple(rewrite_spec(a, rewrite, seen) for a in node.args)
        keywords = {k: rewrite_spec(v, rewrite, seen) for k, v in node.keywords.items()}
        out = rewrite(functools.partial(node.func, *args, **keywords))
    elif isinstance(node, ModuleSpec):
        out = copy.copy(node)
        out.submodules = rewrite_spec(node.submodules, rewrite, seen)
        out = rewrite(out)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = copy.copy(node)
        for field in dataclasses.fields(node):
            # object.__setattr__ also works on frozen dataclasses (out is our own copy).
            object.__setattr__(out, field.name, rewrite_spec(getattr(node, field.name), rewrite, seen))
        out = rewrite(out)
    elif isinstance(node, (list, tuple)):
        out = type(node)(rewrite_spec(item, rewrite, seen) for item in node)
    else:
        return node
    seen[id(node)] = out
    return out
