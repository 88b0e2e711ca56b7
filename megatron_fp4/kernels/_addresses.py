"""Tables of tensor addresses, for kernels that read or write several separate tensors (each expert's
parameter or gradient buffer) in one launch."""

from collections import OrderedDict
from typing import Sequence

import torch

# Address tables by (device, addresses): a model's parameters do not move, so each layer's table is
# copied to the device once, and no step waits on a host-to-device copy. Bounded, for callers whose
# tensors do move.
_address_tables: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_MAX_ADDRESS_TABLES = 1024


def address_table(name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [len(tensors)] on their device: where each starts (16-byte aligned, checked)."""
    addresses = tuple(t.data_ptr() for t in tensors)
    if any(a % 16 for a in addresses):
        raise ValueError(f"{name}: every tensor must start 16-byte aligned")
    device = tensors[0].device
    key = (device, addresses)
    table = _address_tables.get(key)
    if table is None:
        table = torch.tensor(addresses, dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        _address_tables[key] = table
        if len(_address_tables) > _MAX_ADDRESS_TABLES:
            _address_tables.popitem(last=False)
    else:
        _address_tables.move_to_end(key)
    return table
