"""Small helpers for tensors that may be DTensors (FSDP2 shards, expert slices), in one place."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of ``tensor`` if it is a DTensor, else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
