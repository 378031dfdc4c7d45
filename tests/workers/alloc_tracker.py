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


class LiveBytes:
    """Bytes of tensor storages allocated while active and not yet freed, in every Python thread; peak too.

    Allocation tracking as :class:`AllocationTracker` (a dispatch mode sees each new storage), plus a
    finalizer per storage (torch keeps one Python object per storage) that counts its bytes out when it
    is freed. Dispatch modes are per thread, so threads started while active (the source's read thread)
    get one of their own. ``mark()`` starts a new peak; ``extra_peak`` is the most held beyond the mark.
    """

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0
        self.base = 0
        self._known: set[int] = set()
        self._sizes: dict[int, int] = {}  # counted storages alive: address -> bytes
        self.at_peak: list[int] = []  # sizes of the storages allocated since the mark and alive at the peak

    def mark(self) -> None:
        with self._lock:
            self.base = self.peak = self.live
            self._marked = set(self._sizes)
            self.at_peak = []

    @property
    def extra_peak(self) -> int:
        return self.peak - self.base

    def _seen(self, storage) -> None:
        import weakref

        ptr = storage.data_ptr()
        with self._lock:
            if ptr in self._known:
                return
            self._known.add(ptr)
        # Made elsewhere (before the mark, or without an ATen op): not counted, but its address may be reused.
        weakref.finalize(storage, self._freed, ptr, 0)

    def _allocated(self, storage) -> None:
        import weakref

        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if ptr in self._known or nbytes == 0:
                return
            self._known.add(ptr)
            self._sizes[ptr] = nbytes
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
                marked = getattr(self, "_marked", set())
                self.at_peak = sorted((n for p, n in self._sizes.items() if p not in marked), reverse=True)
        weakref.finalize(storage, self._freed, ptr, nbytes)

    def _freed(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._known.discard(ptr)
            self._sizes.pop(ptr, None)
            self.live -= nbytes

    def __enter__(self):
        import threading

        self._mode = _LiveMode(self)
        self._mode.__enter__()
        self._run = threading.Thread.run
        tracker, original = self, self._run

        def run_tracked(thread):
            with _LiveMode(tracker):
                original(thread)

        threading.Thread.run = run_tracked
        return self

    def __exit__(self, *exc):
        import threading

        threading.Thread.run = self._run
        self._mode.__exit__(*exc)


class _LiveMode(TorchDispatchMode):
    def __init__(self, tracker: LiveBytes):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _plain_tensors((args, kwargs)):
            self.tracker._seen(t.untyped_storage())
        out = func(*args, **(kwargs or {}))
        for t in _plain_tensors(out):
            self.tracker._allocated(t.untyped_storage())
        return out


def _plain_tensors(tree):
    tensors = []
    for t in tree_flatten(tree)[0]:
        if type(t) is torch.Tensor and t.device.type != "meta":
            try:
                t.untyped_storage()
            except RuntimeError:
                continue
            tensors.append(t)
    return tensors
