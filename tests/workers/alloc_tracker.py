"""Records every host/device tensor allocation made through ATen while active.

A TorchDispatchMode sees each op's outputs; an output whose storage was not
seen before is a fresh allocation. Meta tensors are ignored (they hold no bytes).
"""

import threading
import weakref

import torch
from torch.distributed.tensor import DTensor
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

    Every storage an ATen op returns that was not seen before is counted, with a finalizer on its storage
    (torch keeps one Python object per storage) that counts it out when it is freed. Three paths that
    a plain dispatch mode misses are covered, as torch's ``MemTracker`` covers them:

    * DTensor: the mode steps aside (``NotImplemented``) so the subclass runs and its
      local ops (the shards ``to_empty`` makes, AdamW's states, a redistribute's buffers) come back
      through the mode as plain tensors;
    * ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates its unsharded parameters that way), which
      is no ATen op: patched while active, it counts the new size;
    * threads started while active (the source's read thread): dispatch modes are per thread, so each
      gets a mode of its own.

    Storages are keyed by their StorageImpl (``_cdata``), not their data pointer: a resized storage keeps
    its key and changes its pointer. Storages first seen as an op's input (made before the tracker, or
    without an ATen op, as a memory-mapped file) are not counted. ``mark()`` starts a new peak;
    ``extra_peak`` is the most held beyond the mark.
    """

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0
        self.base = 0
        self._sizes: dict[int, int] = {}  # counted storages alive: StorageImpl address -> bytes
        self._foreign: set[int] = set()  # storages seen as inputs before any op made them: not counted
        self._marked: set[int] = set()
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
        key = storage._cdata
        with self._lock:
            if key in self._sizes:
                self._resized_locked(key, storage.nbytes())
                return
            if key in self._foreign:
                return
            self._foreign.add(key)
        weakref.finalize(storage, self._forget, key)

    def _allocated(self, storage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self._sizes:
                self._resized_locked(key, nbytes)
                return
            if key in self._foreign:
                return
            self._sizes[key] = nbytes
            self._add_locked(nbytes)
        weakref.finalize(storage, self._freed, key)

    def _resized(self, storage) -> None:
        with self._lock:
            if storage._cdata in self._sizes:
                self._resized_locked(storage._cdata, storage.nbytes())

    def _resized_locked(self, key: int, nbytes: int) -> None:
        change = nbytes - self._sizes[key]
        if change:
            self._sizes[key] = nbytes
            self._add_locked(change)

    def _add_locked(self, change: int) -> None:
        self.live += change
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = sorted((n for k, n in self._sizes.items() if k not in self._marked and n), reverse=True)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live -= self._sizes.pop(key, 0)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._foreign.discard(key)

    def __enter__(self):
        self._mode = _LiveMode(self)
        self._mode.__enter__()
        self._run, self._resize = threading.Thread.run, torch.UntypedStorage.resize_
        tracker, run, resize = self, self._run, self._resize

        def run_tracked(thread):
            with _LiveMode(tracker):
                run(thread)

        def resize_tracked(storage, size):
            result = resize(storage, size)
            tracker._resized(storage)
            return result

        threading.Thread.run = run_tracked
        torch.UntypedStorage.resize_ = resize_tracked
        return self

    def __exit__(self, *exc):
        threading.Thread.run = self._run
        torch.UntypedStorage.resize_ = self._resize
        self._mode.__exit__(*exc)


class _LiveMode(TorchDispatchMode):
    def __init__(self, tracker: LiveBytes):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run: its local ops come back here as plain tensors
        # torch.tensor(data) fills a fresh tensor outside the dispatcher and hands it to lift_fresh: new, not foreign.
        inputs_are_new = func in _LIFT_FRESH
        for storage in _storages((args, kwargs)):
            (self.tracker._allocated if inputs_are_new else self.tracker._seen)(storage)
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            self.tracker._allocated(storage)
        return out


_LIFT_FRESH = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _storages(tree):
    storages = []
    for t in tree_flatten(tree)[0]:
        if type(t) is torch.Tensor and t.device.type != "meta":
            try:
                storages.append(t.untyped_storage())
            except RuntimeError:  # tensors without storage
                continue
    return storages
