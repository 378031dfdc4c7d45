"""The source's send pool: a small fixed pool of buffers, reused for every peer and every round.

A source sends each of its node's ranks its stream, bucket by bucket. Holding
one bucket per peer per round would make its memory grow with the ranks per
node (8 GPUs, 16 NPUs); a pool of :data:`SEND_BUFFERS` buffers, filled in
turn by one read thread, keeps it constant. On an accelerator each slot is a
pinned host buffer (what the read thread fills) plus a device buffer (what the
backend sends): the copy between them is asynchronous, and an event says when
the host side may be filled again.

Every message is a bucket's bytes followed by one flag byte: :data:`ABORT`
tells the receiver that the source failed and sends nothing more, so it stops
at once and joins the fail-together step instead of waiting for bytes that
will never come.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

# Buffers in the pool: one being filled by the read thread while the others are on the wire. With the
# read thread's chunks (at most about half a bucket while one is read, plus the unsent rest of one chunk
# per receiver served at a time: see transport.interleaved), a source holds at most 4 buckets beyond its
# shards, host and device alike, whatever the ranks per node.
SEND_BUFFERS = 3
# The read thread reads a stream in chunks of this fraction of a bucket (at least one row): with the
# conversions of a hub checkpoint (per-expert pieces merged) a chunk costs up to about 4 chunks while read.
READ_CHUNKS_PER_BUCKET = 8

OK, ABORT = 0, 1
FLAG_BYTES = 1


class SendSlot:
    """One buffer of the send pool: host bytes the read thread fills, device bytes the backend sends."""

    def __init__(self, nbytes: int, device: torch.device):
        on_accelerator = device.type != "cpu"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_accelerator)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device) if on_accelerator else self.host
        self._copied: torch.Event | None = None  # the last host-to-device copy out of ``host``

    def host_free(self) -> torch.Tensor:
        """The host buffer, once the asynchronous copy out of it has finished."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self.host

    def message(self, size: int, flag: int = OK) -> torch.Tensor:
        """The first ``size`` bytes plus the flag byte, on the device (an asynchronous copy on accelerators)."""
        self.host[size] = flag
        if self.device is self.host:
            return self.host[:size + FLAG_BYTES]
        # The send is queued after this copy on the current stream; the read thread waits for the event
        # before it overwrites the pinned bytes.
        self.device[:size + FLAG_BYTES].copy_(self.host[:size + FLAG_BYTES], non_blocking=True)
        self._copied = torch.Event()
        self._copied.record()
        return self.device[:size + FLAG_BYTES]


class SendPool:
    """A fixed set of slots; the read thread takes free ones, the sender gives them back once sent."""

    def __init__(self, count: int, bucket_bytes: int, device: torch.device):
        self.slots = [SendSlot(bucket_bytes + FLAG_BYTES, device) for _ in range(count)]
        self._free: queue.Queue = queue.Queue()
        for slot in self.slots:
            self._free.put(slot)

    def acquire(self, stop: threading.Event) -> SendSlot | None:
        while not stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def release(self, slot: SendSlot) -> None:
        self._free.put(slot)


class FilledBuckets:
    """``(slot, peer, size)`` for each ``(peer, size)`` of ``schedule``, filled in order by one read thread.

    ``fill(host_bytes, peer, size)`` writes the bucket; ``after_each(size)`` runs in the read thread after
    each bucket (the source copies about as many bytes of its own shards meanwhile). The consumer gives
    each slot back to ``pool`` once sent. If the thread raises, iteration stops early and ``error`` holds
    the exception, for the sender to abort its receivers with, apart from failures of its own sends.
    """

    def __init__(self, schedule: list[tuple[int, int]], fill: Callable[[torch.Tensor, int, int], None],
                 pool: SendPool, after_each: Callable[[int], None] | None = None):
        self.schedule, self.fill, self.pool, self.after_each = schedule, fill, pool, after_each
        self.error: BaseException | None = None
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()

    def _produce(self) -> None:
        try:
            for peer, size in self.schedule:
                slot = self.pool.acquire(self._stop)
                if slot is None:
                    return
                self.fill(slot.host_free()[:size], peer, size)
                self._ready.put((slot, peer, size))
                if self.after_each is not None:
                    self.after_each(size)
            self._ready.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which fails together
            self._ready.put(exc)

    def __iter__(self) -> Iterator[tuple[SendSlot, int, int]]:
        thread = threading.Thread(target=self._produce, name="twinkle-init-read", daemon=True)
        thread.start()
        try:
            while (item := self._ready.get()) is not None:
                if isinstance(item, BaseException):
                    self.error = item
                    return
                yield item
        finally:
            self._stop.set()
            thread.join()
