"""What an autograd graph keeps for backward, read off its nodes without running it (tests only)."""

import torch


def _saved_by(node):
    """The tensors one node keeps: a custom Function's saved_tensors, a built-in node's
    `_raw_saved_*` values as saved (a saved-tensor hook's package is not a tensor)."""
    if hasattr(node, "saved_tensors"):
        return [t for t in node.saved_tensors if t is not None]
    raw = [getattr(node, name) for name in dir(node) if name.startswith("_raw_saved_")]
    values = [r.data for saved in raw for r in (saved if isinstance(saved, (list, tuple)) else [saved])
              if hasattr(r, "data")]
    return [t for t in values if isinstance(t, torch.Tensor)]


def saved_storages(output: torch.Tensor) -> dict:
    """{storage address: bytes} of every tensor the graph behind `output` keeps for backward."""
    storages, seen, pending = {}, set(), [output.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for tensor in _saved_by(node):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        pending += [next_node for next_node, _ in node.next_functions]
    return storages
