"""Records every host/device tensor allocation made through ATen while active.

A TorchDispatchMode sees each op's outputs; an output whose storage was not
seen before is a fresh allocation. Meta tensors are ignored (they hold no bytes).
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()
        self.allocations: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    def _tensors(self, tree):
        # Plain tensors only: subclasses (DTensor) are seen again as their local tensors.
        return [t for t in tree_flatten(tree)[0] if type(t) is torch.Tensor and t.device.type != "meta"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in self._tensors((args, kwargs)):
            try:
                self.seen.add(t.untyped_storage().data_ptr())
            except RuntimeError:
                pass
        out = func(*args, **(kwargs or {}))
        for t in self._tensors(out):
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
            except RuntimeError:  # tensors without storage
                continue
            if ptr not in self.seen and storage.nbytes() > 0:
                self.seen.add(ptr)
                self.allocations.append((tuple(t.shape), t.dtype, storage.nbytes()))
        return out

    @property
    def largest(self) -> int:
        return max((n for _, _, n in self.allocations), default=0)
