"""Every collective of memory-efficient init, in one place.

Control messages (config, needs, errors) are small pickled objects. Weights
travel as raw bytes in fixed-size buckets from a node's source to the ranks of
that node only (see :func:`move_streams`), so the number of transfers grows
with bytes / bucket size, never with the number of tensors, and no weight
crosses a node boundary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist

from twinkle_strategy import fail_together
from twinkle_strategy.config import INIT_TRANSPORTS
from twinkle_strategy.errors import DistributedInitError
from twinkle_strategy.init.streams import StreamReader, StreamWriter
from twinkle_strategy.runtime import NodeTopology


def raise_together(error: BaseException | str | None, what: str) -> None:
    """:func:`twinkle_strategy.fail_together.raise_together` raising :class:`DistributedInitError`."""
    fail_together.raise_together(error, what, DistributedInitError)


def broadcast_from_source(obj, source: int, node_group) -> object:
    """The node source's ``obj`` on every rank of the node."""
    if node_group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=source, group=node_group)
    return box[0]


def gather_to_source(obj, source: int, node_group, is_source: bool) -> list | None:
    """Every node rank's ``obj``, in local-rank order, on the source (None elsewhere)."""
    if node_group is None:
        return [obj]
    out = [None] * dist.get_world_size(node_group) if is_source else None
    dist.gather_object(obj, out, dst=source, group=node_group)
    return out


def max_over_node(value: int, node_group) -> int:
    if node_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=node_group)
    return int(t.item())


@dataclasses.dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    collective_calls: int = 0


@dataclasses.dataclass(frozen=True)
class NodeLink:
    """What every transfer inside a node needs, together: who is where (the topology, hence the node's
    source), the node's process group, and the device this rank's collectives use."""

    topology: NodeTopology
    group: dist.ProcessGroup | None
    device: torch.device


def bucket_sizes(total: int, bucket_bytes: int) -> list[int]:
    return [min(bucket_bytes, total - k * bucket_bytes) for k in range(math.ceil(total / bucket_bytes))]


TRANSPORTS = INIT_TRANSPORTS


def move_streams(
    kind: str,
    readers: list[StreamReader] | None,
    writer: StreamWriter,
    *,
    node: NodeLink,
    bucket_bytes: int,
    stats: TransferStats,
    progress=None,
    between_rounds: Callable[[int], None] | None = None,
) -> None:
    """Move every local rank's stream from the node source to that rank, bucket by bucket.

    ``readers`` (source only) produce each local rank's bytes; ``writer`` puts
    the bytes this rank receives into its shards. The source's own stream is
    not moved (it copies from its capture): ``between_rounds(n)`` is called on
    the source while a round of ``n`` bytes is on the wire, to do about that
    much of its own copying meanwhile.

    * ``p2p``: for each bucket, the source posts one ``isend`` per receiver that
      still has bytes and each receiver one ``irecv``, paired and in order
      (``batch_isend_irecv``). Every rank receives exactly its stream, however
      uneven the shards. No sub-communicator per peer: HCCL-friendly.
    * ``scatter``: one ``dist.scatter`` per bucket in the node group. All
      ranks must receive equal-sized buckets, so a rank whose stream is
      shorter than its peers' receives padding.
    """
    if node.group is None or node.topology.local_world_size == 1:
        return
    moves = {"p2p": _move_p2p, "scatter": _move_scatter}
    if kind in moves:
        moves[kind](readers, writer, node=node, bucket_bytes=bucket_bytes, stats=stats, progress=progress,
                    between_rounds=between_rounds)
    else:
        raise ValueError(f"unknown init transport {kind!r}; choose one of {TRANSPORTS}")


def _stage(reader: StreamReader, size: int, device: torch.device) -> torch.Tensor:
    staged = torch.empty(size, dtype=torch.uint8)
    reader.read_into(staged)
    return staged.to(device)


def _move_p2p(readers, writer, *, node: NodeLink, bucket_bytes, stats, progress, between_rounds) -> None:
    """Double-buffered: round k+1 is read (and the source's own shards copied) while round k is on the wire."""
    topology, device = node.topology, node.device
    source = topology.source_rank
    node_ranks = topology.node_ranks[topology.node_index]
    if topology.is_source:
        plans = {rank: bucket_sizes(reader.total, bucket_bytes)
                 for rank, reader in zip(node_ranks, readers) if rank != source}
        in_flight: list = []
        for k in range(max((len(p) for p in plans.values()), default=0)):
            ops, sent = [], 0
            for rank, sizes in plans.items():
                if k < len(sizes):
                    bucket = _stage(readers[node_ranks.index(rank)], sizes[k], device)
                    ops.append(dist.P2POp(dist.isend, bucket, rank))
                    sent += sizes[k]
            for work in in_flight:  # the previous round is delivered: its buckets may be freed
                work.wait()
            in_flight = dist.batch_isend_irecv(ops)
            stats.bytes_sent += sent
            stats.buckets += len(ops)
            stats.collective_calls += 1
            if progress is not None:
                progress.update(sent)
            if between_rounds is not None:
                between_rounds(sent)
        for work in in_flight:
            work.wait()
    else:
        # The next bucket's receive is posted before this one is unpacked.
        pending = None
        for size in bucket_sizes(writer.total, bucket_bytes):
            out = torch.empty(size, dtype=torch.uint8, device=device)
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, source)])
            if pending is not None:
                _unpack(pending, writer, stats)
            pending = (works, out)
        if pending is not None:
            _unpack(pending, writer, stats)


def _unpack(pending, writer: StreamWriter, stats: TransferStats) -> None:
    works, out = pending
    for work in works:
        work.wait()
    writer.write(out)
    stats.bytes_received += out.numel()
    stats.buckets += 1
    stats.collective_calls += 1


def _move_scatter(readers, writer, *, node: NodeLink, bucket_bytes, stats, progress, between_rounds) -> None:
    topology, node_group, device = node.topology, node.group, node.device
    source, is_source = topology.source_rank, topology.is_source
    total = max_over_node(writer.total, node_group)
    stats.collective_calls += 1
    for size in bucket_sizes(total, bucket_bytes):
        out = torch.empty(size, dtype=torch.uint8, device=device)
        buckets = None
        if is_source:
            # The source's own slot is a placeholder: it keeps its bytes without a transfer.
            buckets = [out if i == topology.local_rank else _stage(reader, size, device)
                       for i, reader in enumerate(readers)]
            stats.bytes_sent += size * (len(readers) - 1)
            if progress is not None:
                progress.update(size * (len(readers) - 1))
        work = dist.scatter(out, scatter_list=buckets, src=source, group=node_group, async_op=True)
        if is_source and between_rounds is not None:
            between_rounds(size * (len(readers) - 1))
        work.wait()
        stats.buckets += 1
        stats.collective_calls += 1
        if not is_source:
            writer.write(out)
            stats.bytes_received += size
