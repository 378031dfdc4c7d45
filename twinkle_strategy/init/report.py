"""What memory-efficient init did on one rank (:class:`InitReport`), and the byte counts it is made of.

The engine (:mod:`.engine`) fills it in; ``strategy.init_report`` holds it and its :meth:`InitReport.log_line`
is the line every rank logs.
"""

from __future__ import annotations

import dataclasses

from twinkle_strategy import log
from twinkle_strategy.config import QuantizedBase
from twinkle_strategy.errors import shorten
from twinkle_strategy.quantized.kept import KeepingSink, stored_kind


@dataclasses.dataclass
class InitReport:
    """What memory-efficient init did on this rank."""

    rank: int
    is_source: bool
    seconds: float
    bytes_sent: int
    bytes_received: int
    shard_bytes: int  # parameter bytes this rank keeps
    buffer_bytes: int  # buffer bytes this rank keeps (full copies)
    buckets: int
    collective_calls: int
    peak_rss_bytes: int
    tensors: int
    phase_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # plan, transfer, agree
    bytes_read: int = 0  # tensor bytes this rank read from checkpoint files (sources streaming a checkpoint)
    read_seconds: float = 0.0  # time spent in those reads
    whole_tensors: list[str] = dataclasses.field(default_factory=list)  # read whole: no region-wise rule
    # What bytes_sent / bytes_received stand for in the model's dtype: more than them where regions of a
    # quantized release travel as stored (FP8 bytes and scales) and are dequantized by their receiver.
    bytes_sent_decoded: int = 0
    bytes_received_decoded: int = 0
    # This rank's regions of a quantized release's weights, by stored format (fp8_block, fp4_block, mxfp4): the
    # bytes as stored (what quantized_base=keep holds) and in the model's dtype (what dequantize holds).
    quantized_base: str = "dequantize"
    frozen_stored_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    frozen_values_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    # What this rank holds of those regions between steps, counted region by region as held: as stored where
    # kept, in the model's dtype where decoded (every region under dequantize; under keep, the ones listed in
    # frozen_decoded: regions that are not an FSDP2 shard, whose local tensor cannot be swapped).
    frozen_held_bytes: int = 0
    frozen_decoded: list[str] = dataclasses.field(default_factory=list)

    def log_line(self) -> str:
        mib = 1024 * 1024
        read = (f"read {log.mib(self.bytes_read)} from the checkpoint in {self.read_seconds:.2f}s"
                + (f" ({len(self.whole_tensors)} tensors whole: {shorten(self.whole_tensors, 3)})"
                   if self.whole_tensors else "") + ", "
                if self.is_source else "")
        return (f"memory_efficient_init: {self.seconds:.2f}s, rank {self.rank} "
                f"({'source' if self.is_source else 'receiver'}) kept {self.shard_bytes / mib:.1f} MiB of shards "
                f"+ {self.buffer_bytes / mib:.2f} MiB of buffers in {self.tensors} tensors, {read}"
                f"received {self.bytes_received / mib:.1f} MiB{_standing_for(self.bytes_received_decoded, self.bytes_received)}, "
                f"sent {self.bytes_sent / mib:.1f} MiB{_standing_for(self.bytes_sent_decoded, self.bytes_sent)} "
                f"in {self.buckets} buckets ({self.collective_calls} collective calls), "
                f"peak host RSS {self.peak_rss_bytes / mib:.0f} MiB{self._frozen_clause()}")

    def _frozen_clause(self) -> str:
        if not self.frozen_values_bytes:
            return ""
        mib = 1024 * 1024
        stored, values = sum(self.frozen_stored_bytes.values()), sum(self.frozen_values_bytes.values())
        decoded = (f", {len(self.frozen_decoded)} regions decoded: {shorten(self.frozen_decoded, 3)}"
                   if self.frozen_decoded else "")
        return (f"; quantized weights ({', '.join(sorted(self.frozen_stored_bytes))}) held "
                f"{'as stored' if self.quantized_base == QuantizedBase.KEEP else 'dequantized'}{decoded}: "
                f"{self.frozen_held_bytes / mib:.1f} MiB ({stored / mib:.1f} MiB stored, {values / mib:.1f} MiB "
                "in the model dtype)")


def progress_postfix(bytes_read: int) -> str:
    """The init bar's last word: the bytes the source read, as :meth:`InitReport.log_line` writes them."""
    return f"read {log.mib(bytes_read)} from the checkpoint"


def _standing_for(decoded: int, wire: int) -> str:
    return f" (standing for {decoded / 2**20:.1f} MiB of values)" if decoded != wire else ""


def frozen_bytes(mine, my_forms, sinks, *, keep: bool) -> dict:
    """This rank's regions of quantized weights, by stored format: bytes as stored and in the model's dtype; and
    what it holds of them, from each region's sink: as stored where kept, else decoded (named, under keep)."""
    stored: dict[str, int] = {}
    values: dict[str, int] = {}
    held, decoded = 0, []
    for (need, _), form, sink in zip(mine, my_forms, sinks, strict=True):
        if form is None:
            continue
        kind = stored_kind(form)
        stored[kind] = stored.get(kind, 0) + form.nbytes
        values[kind] = values.get(kind, 0) + need.nbytes
        kept = isinstance(sink, KeepingSink)
        held += form.nbytes if kept else need.nbytes
        if keep and not kept:
            decoded.append(need.name)
    return dict(frozen_stored_bytes=stored, frozen_values_bytes=values, frozen_held_bytes=held,
                frozen_decoded=decoded)


def decoded_bytes(my_needs, all_needs, topology) -> dict:
    """The model-dtype bytes this rank received or sent (its own shards move without the wire)."""
    if topology.local_world_size == 1:
        return {}
    if not topology.is_source:
        return dict(bytes_received_decoded=sum(n.nbytes for n in my_needs))
    others = [needs for i, needs in enumerate(all_needs) if i != topology.local_rank]
    return dict(bytes_sent_decoded=sum(n.nbytes for needs in others for n in needs))
