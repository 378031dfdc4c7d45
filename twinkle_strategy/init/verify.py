"""``verify_init``: every region a rank holds checked against its source's bytes by CRC32, before anyone leaves.

Costs a second read of the checkpoint on each source; a mismatch names the tensor, its rows, the rank and both
checksums, and the engine raises it on every rank (fail together).
"""

from __future__ import annotations

import zlib

import torch

from twinkle_strategy.distributed.node import NodeLink, gather_to_source
from twinkle_strategy.init.streams import as_bytes
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan


def _checksum(chunks) -> int:
    crc = 0
    for chunk in chunks:
        crc = zlib.crc32(as_bytes(chunk.detach()).cpu().numpy().tobytes(), crc)
    return crc


def verify_regions(mine: list[torch.Tensor], all_needs, capture, *, ep_plan: ExpertParallelPlan | None,
                   node: NodeLink, compare: bool = True) -> str | None:
    """CRC32 of every region each rank holds (``mine``, its values: kept regions decode for it), compared on its
    source with the bytes it holds or reads again. The mismatch found (one line), or None.

    Collective in the node; a source that already failed (``compare=False``) takes part without comparing.
    """
    topology = node.topology
    sums = [_checksum([local]) for local in mine]
    gathered = gather_to_source(sums, topology.source_rank, node.group)
    if not topology.is_source or not compare:
        return None
    node_ranks = topology.node_ranks[topology.node_index]
    for rank, needs, got in zip(node_ranks, all_needs, gathered, strict=False):
        for need, checksum in zip(needs, got, strict=False):
            expected = _checksum(capture.region_chunks(need, ep_plan, 64 * 2**20))
            if checksum != expected:
                region = f"rows {need.rows[0]}:{need.rows[1]}" if need.rows else "whole tensor"
                expert = f", EP rank {need.ep_rank}" if need.ep_rank >= 0 else ""
                return (f"verify_init: tensor '{need.name}' ({region}{expert}) on rank {rank} has CRC32 "
                        f"{checksum:#010x}, its source rank {topology.source_rank} has {expected:#010x}: "
                        "the bytes were corrupted in transit")
    return None
