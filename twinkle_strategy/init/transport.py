"""The weights of memory-efficient init on the wire: bucketed byte streams inside each node.

Control messages (config, needs, errors) go through the node-level primitives
of :mod:`twinkle_strategy.distributed.node`. Weights travel here, as raw bytes
in fixed-size buckets from a node's source to the ranks of that node only (see
:func:`move_streams`), so the number of transfers grows with bytes / bucket
size, never with the number of tensors, and no weight crosses a node boundary.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from twinkle_strategy.config import INIT_TRANSPORTS, InitTransport
from twinkle_strategy.distributed import messages
from twinkle_strategy.distributed.node import NodeLink, max_over_node
from twinkle_strategy.errors import StrategyConfigError
from twinkle_strategy.init import send_pool
from twinkle_strategy.init.streams import StreamReader, StreamWriter


@dataclasses.dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    collective_calls: int = 0


def bucket_sizes(total: int, bucket_bytes: int) -> list[int]:
    return [min(bucket_bytes, total - k * bucket_bytes) for k in range(math.ceil(total / bucket_bytes))]


TRANSPORTS = INIT_TRANSPORTS


@dataclasses.dataclass
class Outcome:
    """How a node's transfer ended. ``aborted`` is the same on every rank of the node."""

    aborted: bool = False  # the source failed and stopped sending: this node's shards are incomplete
    error: BaseException | None = None  # what the source's reading raised (on the source only)


def move_streams(
    kind: InitTransport | str,
    readers: list[StreamReader] | None,
    writer: StreamWriter,
    *,
    node: NodeLink,
    bucket_bytes: int,
    stats: TransferStats,
    progress=None,
    between_rounds: Callable[[int], None] | None = None,
) -> Outcome:
    """Move every local rank's stream from the node source to that rank, bucket by bucket.

    ``readers`` (source only) produce each local rank's bytes; ``writer`` puts
    the bytes this rank receives into its shards. The source's own stream is
    not moved (it copies from its capture): ``between_rounds(n)`` is called on
    the source after about ``n`` bytes were staged for sending, to do about that
    much of its own copying meanwhile.

    The source stages through a fixed pool of buffers (:mod:`send_pool`), so its
    memory beyond its shards stays a few buckets whatever the ranks per node.
    If its reading fails (a file cut short or removed, a bad tensor), it flags
    the next message each receiver waits for as an abort and stops; the error
    comes back in the :class:`Outcome` for the caller's fail-together step.

    * ``p2p``: the source posts one ``isend`` per bucket, round-robin over a
      few receivers at a time (:func:`interleaved`), and each receiver one
      ``irecv`` per bucket, paired and in order (``batch_isend_irecv``). Every rank receives exactly its stream,
      however uneven the shards. No sub-communicator per peer: HCCL-friendly.
    * ``scatter``: one ``dist.scatter`` per round in the node group, each
      receiver's slice a share of one bucket. All ranks receive equal-sized
      slices, so a rank whose stream is shorter than its peers' receives padding.
    """
    if node.group is None or node.topology.local_world_size == 1:
        return Outcome()
    if kind not in TRANSPORTS:
        raise StrategyConfigError("init_transport", f"unknown init transport {kind!r}; choose one of {TRANSPORTS}")
    move = _move_p2p if kind == InitTransport.P2P else _move_scatter
    return move(readers, writer, node=node, bucket_bytes=bucket_bytes, stats=stats, progress=progress,
                between_rounds=between_rounds)


def _fill_from(readers: list[StreamReader], peer_index: dict[int, int]):
    def fill(host: torch.Tensor, peer: int, size: int) -> None:
        got = readers[peer_index[peer]].read_into(host)
        if got != size:
            raise AssertionError(f"the stream for rank {peer} ended {size - got} bytes early")
    return fill


def send_bucket(message: torch.Tensor, peer: int) -> list:
    """Start sending one bucket to ``peer``; the requests to wait on. (The one place a source sends a bucket,
    so that the reliability tests can stop a source mid-transfer here.)"""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, message, peer)])


def _move_p2p(readers, writer, *, node: NodeLink, bucket_bytes, stats, progress, between_rounds) -> Outcome:
    topology, device = node.topology, node.device
    if topology.is_source:
        return _send_p2p(readers, topology, bucket_bytes=bucket_bytes, device=device, stats=stats,
                         progress=progress, between_rounds=between_rounds)
    return _receive_p2p(writer, topology.source_rank, bucket_bytes=bucket_bytes, device=device, stats=stats)


def _send_p2p(readers, topology, *, bucket_bytes, device, stats, progress, between_rounds) -> Outcome:
    """Every receiver's buckets, through the send pool, a few receivers at a time; a read error aborts."""
    node_ranks = topology.node_ranks[topology.node_index]
    plans = {rank: bucket_sizes(readers[i].total, bucket_bytes)
             for i, rank in enumerate(node_ranks) if rank != topology.source_rank}
    schedule = interleaved(plans, window=send_pool.SEND_BUFFERS)
    pool = send_pool.SendPool(send_pool.SEND_BUFFERS, bucket_bytes, device)
    sent = dict.fromkeys(plans, 0)  # buckets sent to each receiver
    in_flight: collections.deque = collections.deque()
    buckets = send_pool.FilledBuckets(schedule, _fill_from(readers, {rank: i for i, rank in enumerate(node_ranks)}),
                                    pool, between_rounds)
    filled = iter(buckets)
    try:
        for slot, rank, size in filled:
            in_flight.append((send_bucket(slot.message(size), rank), slot))
            sent[rank] += 1
            _count_sent(size, stats, progress)
            # Keep one slot for the read thread to fill while the others are on the wire.
            while len(in_flight) >= len(pool.slots):
                _release_oldest(in_flight, pool)
    finally:
        filled.close()  # a failed send stops the read thread now, not when the traceback is freed
    error = buckets.error
    while in_flight:
        _release_oldest(in_flight, pool)
    if error is not None:
        _send_aborts(plans, sent, pool.slots[0])
    return Outcome(aborted=error is not None, error=error)


def _count_sent(size: int, stats: TransferStats, progress) -> None:
    stats.bytes_sent += size
    stats.buckets += 1
    stats.collective_calls += 1
    if progress is not None:
        progress.update(size)


def interleaved(plans: dict[int, list[int]], window: int) -> list[tuple[int, int]]:
    """``(rank, bucket size)`` in sending order: round-robin over at most ``window`` receivers at a time.

    Receivers unpack in parallel while the source serves the others, which keeps the transfer as fast
    as serving all of them at once; only ``window`` streams are part-read at any moment, so the chunks
    they hold between two buckets stay a few, whatever the ranks per node.
    """
    waiting = [(rank, list(sizes)) for rank, sizes in plans.items() if sizes]
    active: list[tuple[int, list[int]]] = []
    order = []
    while waiting or active:
        while waiting and len(active) < window:
            active.append(waiting.pop(0))
        for rank, sizes in list(active):
            order.append((rank, sizes.pop(0)))
            if not sizes:
                active.remove((rank, sizes))
    return order


def _release_oldest(in_flight: collections.deque, pool: send_pool.SendPool) -> None:
    works, slot = in_flight.popleft()
    messages.wait_all(works)
    pool.release(slot)


def _send_aborts(plans: dict[int, list[int]], sent: dict[int, int], slot: send_pool.SendSlot) -> None:
    """Each receiver that still expects bytes gets its next message (and the one it posted ahead) as ABORT."""
    for rank, sizes in plans.items():
        for size in sizes[sent[rank]:sent[rank] + 2]:
            slot.host_free()[:size].zero_()
            messages.wait_all(send_bucket(slot.message(size, send_pool.ABORT), rank))


def _receive_p2p(writer, source, *, bucket_bytes, device, stats) -> Outcome:
    """One ``irecv`` per bucket; the next is posted before this one is unpacked (so at most two buckets)."""
    pending = None
    for size in bucket_sizes(writer.total, bucket_bytes):
        message = torch.empty(size + send_pool.FLAG_BYTES, dtype=torch.uint8, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, message, source)])
        if pending is not None and not _unpack(pending, writer, stats):
            messages.wait_all(works)  # the source sends the message posted ahead too, flagged: nothing is left pending
            return Outcome(aborted=True)
        pending = (works, message)
    if pending is not None and not _unpack(pending, writer, stats):
        return Outcome(aborted=True)
    return Outcome()


def _unpack(pending, writer: StreamWriter, stats: TransferStats) -> bool:
    """Write a received bucket into the shards; False if the source flagged it as an abort."""
    works, message = pending
    messages.wait_all(works)
    size = message.numel() - send_pool.FLAG_BYTES
    if int(message[size].item()) == send_pool.ABORT:
        return False
    writer.write(message[:size])
    stats.bytes_received += size
    stats.buckets += 1
    stats.collective_calls += 1
    return True


def _move_scatter(readers, writer, *, node: NodeLink, bucket_bytes, stats, progress, between_rounds) -> Outcome:
    """One scatter per round; the receivers' slices together fill one bucket (bounded source memory)."""
    topology, node_group, device = node.topology, node.group, node.device
    is_source, me = topology.is_source, topology.local_rank
    total = max_over_node(writer.total, node_group)
    stats.collective_calls += 1
    receivers = topology.local_world_size - 1
    share = max(bucket_bytes // receivers, 1)
    slot = send_pool.SendSlot(receivers * (share + send_pool.FLAG_BYTES), device) if is_source else None
    error = None
    for size in bucket_sizes(total, share):
        out = torch.empty(size + send_pool.FLAG_BYTES, dtype=torch.uint8, device=device)
        buckets = None
        if is_source:
            buckets, error = _stage_round(readers, slot, size, me, out, error)
            stats.bytes_sent += size * receivers
            if progress is not None:
                progress.update(size * receivers)
        work = dist.scatter(out, scatter_list=buckets, src=topology.source_rank, group=node_group, async_op=True)
        if is_source and between_rounds is not None and error is None:
            try:
                between_rounds(size * receivers)
            except Exception as exc:  # noqa: BLE001 - the next round is flagged; reported by the caller
                error = exc
        work.wait()
        stats.collective_calls += 1
        if int(out[size].item()) == send_pool.ABORT:
            return Outcome(aborted=True, error=error)
        stats.buckets += 1
        if not is_source:
            writer.write(out[:size])
            stats.bytes_received += size
    return Outcome(error=error)  # the source's own copying may have failed after the last round


def _stage_round(readers, slot, size, me, own_out, error):
    """The scatter list of one round, each receiver's slice read into the slot (flagged ABORT on an error)."""
    host = slot.host_free()
    views, width = [], size + send_pool.FLAG_BYTES
    for i, reader in enumerate(readers):
        if i == me:
            continue
        view = host[len(views) * width:(len(views) + 1) * width]
        if error is None:
            try:
                reader.read_into(view[:size])
            except Exception as exc:  # noqa: BLE001 - every rank learns it from the flag, then fails together
                error = exc
        views.append(view)
    flag = send_pool.OK if error is None else send_pool.ABORT
    for view in views:
        view[size] = flag
    own_out[size] = flag
    staged = slot.message(len(views) * width - send_pool.FLAG_BYTES, flag)  # the whole round, one copy
    slices = iter(staged[k * width:(k + 1) * width] for k in range(len(views)))
    return [own_out if i == me else next(slices) for i in range(len(readers))], error
