"""What a weight export did, per rank: a returned object and one log line."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from twinkle_strategy.distributed.messages import collective_device


@dataclasses.dataclass(frozen=True)
class RankFigures:
    rank: int
    bytes_sent: int  # tensor bytes this rank sent to another rank
    bytes_kept: int  # bytes a destination took from its own shard (nothing crossed the wire)
    bytes_received: int
    seconds_blocked: float  # waiting in transfers and agreements
    peak_extra_bytes: int  # host (or device) memory above what the rank held when the export began
    shard_bytes: int  # this rank's shards of the exported tensors
    bytes_held: int = 0  # the most tensor bytes the export itself allocated for one bucket (exact, by storage)


@dataclasses.dataclass(frozen=True)
class ExportReport:
    buckets: int
    tensors: int  # checkpoint tensors the destinations received
    bytes_total: int  # of the exported tensors, as sent (once)
    largest_bucket_bytes: int
    seconds: float
    ranks: tuple[RankFigures, ...]  # every rank's figures, by global rank

    def log_line(self) -> str:
        sent = ", ".join(f"r{f.rank} {f.bytes_sent / 2**20:.1f}" for f in self.ranks)
        blocked = max(f.seconds_blocked for f in self.ranks)
        peak = max(f.peak_extra_bytes for f in self.ranks)
        held = max(f.bytes_held for f in self.ranks)
        return (f"weight export: {self.tensors} tensors, {self.bytes_total / 2**20:.1f} MiB in {self.buckets} "
                f"buckets (largest {self.largest_bucket_bytes / 2**20:.1f} MiB) in {self.seconds:.2f}s; MiB sent per "
                f"rank: {sent}; blocked at most {blocked:.2f}s; tensors held for a bucket at most {held / 2**20:.1f} MiB; "
                f"peak extra memory at most {peak / 2**20:.1f} MiB")


def all_figures(mine: RankFigures) -> tuple[RankFigures, ...]:
    """Every rank's figures (collective: one small all_gather on the backend's device)."""
    values = [mine.bytes_sent, mine.bytes_kept, mine.bytes_received, int(mine.seconds_blocked * 1e6),
              mine.peak_extra_bytes, mine.shard_bytes, mine.bytes_held]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return (mine,)
    local = torch.tensor(values, dtype=torch.int64, device=collective_device())
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return tuple(RankFigures(rank, s, k, r, b / 1e6, p, sh, h)
                 for rank, (s, k, r, b, p, sh, h) in enumerate(t.cpu().tolist() for t in gathered))
