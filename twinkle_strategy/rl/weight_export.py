"""The trained weights, bucket by bucket, to a rollout engine: the checkpoint save walk with a process group
where the file was.

Every rank walks the same plan (:mod:`twinkle_strategy.rl.export_plan`). For each bucket, each rank that keeps
rows of the bucket's tensors sends exactly those rows to the bucket's destination rank (one batch of paired
point-to-point transfers per bucket; an expert's rows come only from the ranks of its EP group that keep them,
an FSDP shard only from its owner), which receives them straight into the bucket's tensors, turns them into the
checkpoint's own tensors (transformers' conversions reverted: per-expert hub keys, renames, by
:meth:`CheckpointLayout.checkpoint_pieces`) and hands the bucket to the engine. Nobody holds the whole model: a
destination holds one bucket, a sender the rows of the bucket it sends (a copy only when cast to the engine's
dtype).

Fail together: before the first byte, the destination asks the receiver to check the list of tensors it is
about to get (a receiver whose model differs refuses by name); before each bucket every rank learns, in one small
all-reduce, whether a destination's receiver failed (the engine died), and then every rank raises
:class:`~twinkle_strategy.errors.WeightSyncError`. The model is only read: a failed export leaves training as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from twinkle_strategy.checkpoint.layout import CheckpointLayout, RowMode
from twinkle_strategy.distributed.fail_together import raise_together
from twinkle_strategy.distributed.messages import collective_device, wait_all
from twinkle_strategy.distributed.runtime import peak_rss_since_reset, reset_peak_rss, rss_bytes
from twinkle_strategy.errors import ArgumentError, WeightSyncError
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.quantized.kept import KeptWeight
from twinkle_strategy.rl.export_plan import (
    BucketPlan,
    EngineExperts,
    Item,
    OneReceiver,
    TensorPlan,
    overlaps,
    plan_buckets,
    plan_items,
)
from twinkle_strategy.rl.export_report import ExportReport, RankFigures, all_figures
from twinkle_strategy.rl.export_sources import ExportSource, ExportTensor
from twinkle_strategy.shards.plan import Need, checkpoint_runs
from twinkle_strategy.shards.whole_tensors import WholeTensors

logger = logging.getLogger(__name__)

WHAT = "sending the trained weights to the rollout engine"


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One tensor a destination is about to receive: what a receiver checks before any byte moves."""

    name: str  # the checkpoint's key
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Checkpoint tensors, whole, on the bucket's destination rank (empty on the other ranks)."""

    index: int
    dest: int
    tensors: list[tuple[str, torch.Tensor]]
    nbytes: int


@dataclasses.dataclass
class _Counters:
    sent: int = 0
    kept: int = 0
    received: int = 0
    blocked: float = 0.0
    held: int = 0  # the most tensor bytes the export itself held for one bucket


class WeightExport:
    """An export, planned on every rank (collective: one small all_gather per destination). Iterate it on every
    rank in step, or hand it a receiver with :meth:`send_to`; :attr:`report` is set once it is done."""

    def __init__(self, source: ExportSource, *, ep_plan: ExpertParallelPlan | None, bucket_bytes: int,
                 receivers: OneReceiver | EngineExperts, on_done: Callable[[], None] = lambda: None):
        if bucket_bytes <= 0:
            raise ArgumentError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.source, self.ep_plan = source, ep_plan
        self.tensors: list[ExportTensor] = source.tensors
        self.rank = dist.get_rank()
        outside = [r for r in receivers.ranks if not 0 <= r < dist.get_world_size()]
        if outside:
            raise ArgumentError(f"receivers {receivers} name rank(s) {outside}, outside this job's "
                             f"{dist.get_world_size()} ranks")
        needs = [t.region.need for t in self.tensors]
        # Who keeps which rows of every tensor (one all_gather each), and a whole-tensor gather per destination
        # for the few regions that are not rows (PEFT's expert lora_B).
        self.tables = {dest: WholeTensors(needs, ep_plan, owner=lambda name, d=dest: d) for dest in receivers.ranks}
        self.table = self.tables[receivers.ranks[0]]
        self.runs = [[checkpoint_runs(self.table.need_at(i, key), ep_plan, t.region.full_shape)
                      if not t.region.need.is_buffer else None for key in self.table.keys[i]]
                     for i, t in enumerate(self.tensors)]
        specs = [TensorPlan(t.region.full_shape, t.dtype, self._by_experts(i),
                            t.region.full_shape[0] if t.region.full_shape else 0, t.key)
                 for i, t in enumerate(self.tensors)]
        experts = {i for i, t in enumerate(self.tensors) if ep_plan is not None and t.region.name in ep_plan.axes}
        self.plan: list[BucketPlan] = plan_buckets(
            plan_items(specs, bucket_bytes=bucket_bytes, receivers=receivers, expert_tensors=experts), bucket_bytes)
        self.dests = set(receivers.ranks)
        self.report: ExportReport | None = None
        self._on_done = on_done
        # (a frozen weight kept as stored has no storage of values: the rows it sends are decoded, held copies)
        self._shard_storages = {t.region.local.untyped_storage().data_ptr() for t in self.tensors
                                if not isinstance(t.region.local, KeptWeight)}
        self.release = source.release  # a release-format export: the release's untouched tensors, after the rest
        self._renames = source.release.renames if source.release is not None else {}

    def _by_experts(self, i: int) -> bool:
        """Whether tensor ``i`` may be cut between buckets: rows of it are experts with keys of their own."""
        layout, key = self.source.layout, self.tensors[i].key
        return (isinstance(layout, CheckpointLayout) and layout.row_writable(key)
                and layout.recipes[key].mode == RowMode.PER_EXPERT and all(r is not None for r in self.runs[i]))

    # ------------------------------------------------------------------ what a destination gets
    def manifest(self, *, rank: int | None = None) -> list[TensorMeta]:
        """The checkpoint tensors the buckets of ``rank`` (default: this rank) will hold, in order (no transfer:
        shapes only; every rank knows every destination's)."""
        rank = self.rank if rank is None else rank
        out = []
        for plan in self.plan:
            if plan.dest != rank:
                continue
            for item in plan.items:
                t = self.tensors[item.tensor]
                meta = torch.empty(_rows_shape(t.region.full_shape, item.rows), dtype=t.dtype, device="meta")
                out += [TensorMeta(self._renames.get(key, key), tuple(value.shape), value.dtype)
                        for key, value, _ in self.source.layout.checkpoint_pieces(t.key, meta, item.rows)]
        if self.release is not None and self.rank in self.dests:
            out += [TensorMeta(key, shape, dtype) for bucket in self.release.buckets for key, shape, dtype in bucket]
        return out

    # ------------------------------------------------------------------ the walk
    def __iter__(self) -> Iterator[Bucket]:
        """Every bucket, on every rank in the same order (tensors only on its destination). The loop's body must
        not raise on some ranks only: hand a receiver that may fail to :meth:`send_to` instead."""
        return self._walk([])

    def send_to(self, receiver: Callable[[Bucket], None]) -> ExportReport:
        """Run the export; each destination rank calls ``receiver(bucket)`` for its buckets (other ranks may pass
        None). A receiver may have ``prepare(manifest)``, called before any byte moves (raise to refuse: a model
        that differs), and ``finish()``, called after the last bucket. Any failure raises WeightSyncError on
        every rank."""
        error = None
        prepare = getattr(receiver, "prepare", None)
        if self.rank in self.dests and prepare is not None:
            try:
                prepare(self.manifest())
            except Exception as exc:  # noqa: BLE001 - raised on every rank just below
                error = exc
        raise_together(error, f"{WHAT} (the receiver's check, before any byte moved)", WeightSyncError)
        errors: list[BaseException] = []
        for bucket in self._walk(errors):
            if bucket.dest == self.rank:
                try:
                    receiver(bucket)
                except Exception as exc:  # noqa: BLE001 - every rank raises at the next agreement
                    errors.append(exc)
            del bucket  # not held while the next one is assembled
        finish = getattr(receiver, "finish", None)
        error = None
        if self.rank in self.dests and finish is not None:
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - raised on every rank just below
                error = exc
        raise_together(error, f"{WHAT} (the receiver's finish)", WeightSyncError)
        return self.report

    def _walk(self, errors: list[BaseException]) -> Iterator[Bucket]:
        start, counters = time.perf_counter(), _Counters()
        reset_peak_rss()
        device_peak = _reset_device_peak()
        rss_before = rss_bytes()
        tensors_received = 0
        for plan in self.plan:
            self._agree(errors, counters)
            bucket = self._transfer(plan, counters, errors)
            tensors_received += len(bucket.tensors)
            yield bucket
            # Before the next bucket is allocated: drop this one's tensors even where the caller's loop variable
            # still holds the bucket (a caller that kept the tensors themselves keeps them).
            bucket.tensors.clear()
            del bucket
        for n in range(self.release.count if self.release is not None else 0):  # the release's, as stored
            self._agree(errors, counters)
            bucket = self._release_bucket(n, counters)
            tensors_received += len(bucket.tensors)
            yield bucket
            bucket.tensors.clear()
            del bucket
        self._agree(errors, counters)
        mine = RankFigures(self.rank, counters.sent, counters.kept, counters.received, counters.blocked,
                           max(peak_rss_since_reset() - rss_before, device_peak()), self._shard_bytes(), counters.held)
        here = self.release is not None and self.rank in self.dests
        release = [self.release.bucket_bytes(n) for n in range(self.release.count)] if here else []
        total = torch.tensor([tensors_received, sum(release), max(release, default=0)], dtype=torch.int64,
                             device=collective_device())
        dist.all_reduce(total)  # (the release's buckets: on its one destination only)
        tensors, release_bytes, largest_release = total.tolist()
        self.report = ExportReport(
            buckets=len(self.plan) + (self.release.count if self.release is not None else 0), tensors=tensors,
            bytes_total=sum(p.nbytes for p in self.plan) + release_bytes,
            largest_bucket_bytes=max(max((p.nbytes for p in self.plan), default=0), largest_release),
            seconds=time.perf_counter() - start, ranks=all_figures(mine))
        if self.rank == min(self.dests):
            logger.info(self.report.log_line())
        self._on_done()

    def _release_bucket(self, n: int, counters: _Counters) -> Bucket:
        """The release's untouched tensors of bucket ``n``, read as stored by the destination (no transfer)."""
        index, dest = len(self.plan) + n, next(iter(self.dests))
        if self.rank not in self.dests:
            return Bucket(index, dest, [], 0)
        tensors = self.release.read(n)
        nbytes = sum(value.numel() * value.element_size() for _, value in tensors)
        counters.kept += nbytes
        counters.held = max(counters.held, nbytes)
        if n == self.release.count - 1:
            self.release.close()
        return Bucket(index, dest, tensors, nbytes)

    def _shard_bytes(self) -> int:
        return sum(t.region.local.numel() * t.dtype.itemsize for t in self.tensors)

    def _agree(self, errors: list[BaseException], counters: _Counters) -> None:
        """Every rank learns whether any rank failed since the last agreement; if so all raise together."""
        began = time.perf_counter()
        flag = torch.tensor([1 if errors else 0], dtype=torch.int64, device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        counters.blocked += time.perf_counter() - began
        if flag.item():
            raise_together(errors[0] if errors else None, WHAT, WeightSyncError,
                           advice="the model is unchanged; restart the engine (or the receiver) and export again")

    def _transfer(self, plan: BucketPlan, counters: _Counters, errors: list[BaseException]) -> Bucket:
        """One bucket's rows from their owners to ``plan.dest`` (collective), then its checkpoint tensors there."""
        here = plan.dest == self.rank
        chunks: dict[int, torch.Tensor] = {}
        ops, keep_alive = [], []
        tags: dict[int, int] = {}  # sender -> transfers it has in this bucket so far: the pair's own numbering
        whole = {n for n, item in enumerate(plan.items) if any(r is None for r in self.runs[item.tensor])}
        for n, item in enumerate(plan.items):
            if n in whole:
                continue
            t = self.tensors[item.tensor]
            rows = item.rows or (0, t.region.full_shape[0] if t.region.full_shape else 1)
            if here:
                chunks[n] = torch.empty(_rows_shape(t.region.full_shape, item.rows), dtype=t.dtype,
                                        device=t.region.local.device)
            for sender, runs in self._senders(item.tensor, plan.dest):
                for src, dst, count in overlaps(runs, rows):
                    nbytes = count * _row_bytes(t)
                    if sender == self.rank and here:
                        chunks[n][dst:dst + count].copy_(_local_rows(t, src, src + count))
                        counters.kept += nbytes
                    elif sender == self.rank:
                        piece = _local_rows(t, src, src + count).to(t.dtype).contiguous()
                        keep_alive.append(piece)
                        ops.append(dist.P2POp(dist.isend, piece, plan.dest, tag=_next(tags, sender)))
                        counters.sent += nbytes
                    elif here:
                        ops.append(dist.P2POp(dist.irecv, chunks[n][dst:dst + count], sender,
                                              tag=_next(tags, sender)))
                        counters.received += nbytes
        began = time.perf_counter()
        if ops:
            wait_all(dist.batch_isend_irecv(ops))
        copies = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in keep_alive}
        # A sender's casts (rows it sends in the training dtype are views of its shard: nothing held).
        counters.held = max(counters.held, sum(n for ptr, n in copies.items() if ptr not in self._shard_storages))
        del keep_alive, copies
        for n in sorted(whole):
            chunks[n] = self._gather_whole(plan.items[n], plan.dest, counters)
        counters.blocked += time.perf_counter() - began
        if not here:
            return Bucket(plan.index, plan.dest, [], plan.nbytes)
        out = []
        try:
            for n, item in enumerate(plan.items):
                t = self.tensors[item.tensor]
                out += [(self._renames.get(key, key), value) for key, value, _ in
                        self.source.layout.checkpoint_pieces(t.key, chunks[n].reshape(
                            _rows_shape(t.region.full_shape, item.rows)), item.rows)]
        except Exception as exc:  # noqa: BLE001 - every rank raises at the next agreement
            errors.append(exc)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*chunks.values(), *(value for _, value in out)] if t is not None}
        counters.held = max(counters.held, sum(storages.values()))  # the bucket and what its conversion copied
        return Bucket(plan.index, plan.dest, out, plan.nbytes)

    def _senders(self, i: int, dest: int) -> list[tuple[int, list[tuple[int, int]]]]:
        """(rank, its runs) for each distinct region of tensor ``i`` with bytes: the destination itself where it
        keeps the same region (replicas: nothing crosses the wire), else the first rank keeping it."""
        keys = self.table.keys[i]
        out = {}
        for rank in [dest] + [r for r in range(len(keys)) if r != dest]:
            key = keys[rank]
            if key not in out and self.table.need_at(i, key).nbytes:
                out[key] = (rank, self.runs[i][rank])
        return list(out.values())

    def _gather_whole(self, item: Item, dest: int, counters: _Counters) -> torch.Tensor | None:
        """Tensor ``item.tensor`` whole on ``dest`` from regions that are not rows (collective)."""
        i, t = item.tensor, self.tensors[item.tensor]
        table = self.tables[dest]
        if t.region.need.is_buffer:
            if self.rank == dest:
                counters.kept += t.region.local.numel() * t.dtype.itemsize
            return _values(t.region.local).to(t.dtype) if self.rank == dest else None
        for key, sender in table.senders(i).items():
            nbytes = _need_bytes(table.need_at(i, key), t.dtype)
            if sender == self.rank and self.rank != dest and key != table.keys[i][dest]:
                counters.sent += nbytes
            elif self.rank == dest:
                counters.kept += nbytes if key == table.keys[i][dest] else 0
                counters.received += nbytes if key != table.keys[i][dest] else 0
        return table.gather(i, _values(t.region.local).to(t.dtype))


def _next(tags: dict[int, int], sender: int) -> int:
    tags[sender] = tags.get(sender, -1) + 1
    return tags[sender]


def _need_bytes(need: Need, dtype: torch.dtype) -> int:
    return need.nbytes // need.dtype.itemsize * dtype.itemsize


def _rows_shape(shape: tuple[int, ...], rows: tuple[int, int] | None) -> tuple[int, ...]:
    if rows is None or not shape:
        return tuple(shape)
    return (rows[1] - rows[0],) + tuple(shape[1:])


def _row_bytes(t: ExportTensor) -> int:
    shape = t.region.full_shape
    count = 1
    for size in shape[1:]:
        count *= size
    return count * t.dtype.itemsize


def _local_rows(t: ExportTensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of this rank's region of ``t`` (a scalar as one row); of a frozen weight kept as
    stored (``quantized_base: keep``), those rows decoded into a new tensor, as its forward would decode them."""
    local = t.region.local
    if isinstance(local, KeptWeight):
        return local.rows(start, stop)
    return (local.reshape(1) if not t.region.full_shape else local)[start:stop]


def _values(local: torch.Tensor) -> torch.Tensor:
    return local.values() if isinstance(local, KeptWeight) else local


def _reset_device_peak() -> Callable[[], int]:
    """A function giving the accelerator memory allocated above now, at its peak since this call (0 on CPU)."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != "cuda":
        return lambda: 0
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    return lambda: torch.cuda.max_memory_allocated() - before
