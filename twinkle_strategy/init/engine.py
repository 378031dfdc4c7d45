"""The memory-efficient init's transfer, step by step (README, "What the strategy does").

``strategy.from_pretrained`` builds the model (placeholders or meta, see :mod:`.skeleton`) and, on
each node's source, the :class:`~.capture.Capture` of what it will send. :func:`distribute` runs inside
``strategy.wrap_model`` after EP, ``fully_shard`` on meta and ``to_empty``: plan (who needs which
rows), transfer (buckets inside each node), agree (fail together, after :mod:`.verify`'s checksums with
``verify_init``), and returns the rank's :class:`~.report.InitReport`. Between the two the user may add
PEFT adapters.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from twinkle_strategy.config import DEFAULT_INIT_BUCKET_MB, InitTransport, QuantizedBase
from twinkle_strategy.distributed.fail_together import raise_init_together
from twinkle_strategy.distributed.fatal_errors import stopped_by_peer
from twinkle_strategy.distributed.liveness import StatusBoard
from twinkle_strategy.distributed.node import NodeLink, gather_to_source, scatter_from_source
from twinkle_strategy.distributed.runtime import peak_rss_bytes
from twinkle_strategy.errors import DistributedInitError
from twinkle_strategy.init import transport
from twinkle_strategy.init.capture import Capture
from twinkle_strategy.init.report import InitReport, decoded_bytes, frozen_bytes, progress_postfix
from twinkle_strategy.init.send_pool import READ_CHUNKS_PER_BUCKET
from twinkle_strategy.init.streams import StreamReader, StreamWriter, as_bytes
from twinkle_strategy.init.verify import verify_regions
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.quantized.formats import is_quantized_release
from twinkle_strategy.quantized.kept import KeepingSink, keep_regions
from twinkle_strategy.quantized.wire import DecodingSink
from twinkle_strategy.shards.plan import Need, check_need, needs_of

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = int(DEFAULT_INIT_BUCKET_MB * 2**20)


def distribute(
    model: nn.Module,
    capture: Capture | None,
    *,
    ep_plan: ExpertParallelPlan | None,
    node: NodeLink,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport_kind: InitTransport | str = InitTransport.P2P,
    verify: bool = False,
    show_progress: bool = False,
    quantized_base: QuantizedBase | str = QuantizedBase.DEQUANTIZE,
) -> InitReport:
    """Fill every rank's shards (materialised, uninitialised) from its node source's capture. Collective.

    Any failure - a tensor the source cannot serve, a checksum mismatch, a peer
    that died or hung - ends as a :class:`DistributedInitError` on every rank,
    naming the rank(s) at fault.

    ``quantized_base=keep``: regions of a quantized release that travel as stored are kept so
    (:mod:`twinkle_strategy.quantized.kept`); a trainable one is refused on every rank before any byte moves.
    """
    keep = QuantizedBase(quantized_base) == QuantizedBase.KEEP
    topology = node.topology
    board = StatusBoard("init")
    start = time.perf_counter()
    stats = transport.TransferStats()
    phase = "plan"
    phase_seconds: dict[str, float] = {}

    def finish(name: str, since: float) -> float:
        board.finished(name)
        now = time.perf_counter()
        phase_seconds[name] = now - since
        return now

    try:
        mine = needs_of(model, ep_plan)
        all_needs = _plan(mine, capture, ep_plan=ep_plan, node=node, stats=stats)
        if capture is not None:
            capture.expect(all_needs, ep_plan)
        forms, my_forms = _wire_forms(all_needs, capture, ep_plan=ep_plan, node=node, bucket_bytes=bucket_bytes,
                                      stats=stats) if is_quantized_release(model) else _as_values(all_needs, mine)
        if keep and is_quantized_release(model):
            raise_init_together(_trainable_kept(model, mine, my_forms), "memory_efficient_init")
            stats.collective_calls += 1
        t = finish(phase, start)
        phase = "transfer"
        sinks = [_sink(need, local, form, model.config, keep=keep) for (need, local), form in
                 zip(mine, my_forms, strict=False)]
        outcome = _transfer(mine, sinks, all_needs, forms=forms, capture=capture, ep_plan=ep_plan, node=node,
                            bucket_bytes=bucket_bytes, transport_kind=transport_kind, stats=stats,
                            show_progress=show_progress)
        t = finish(phase, t)
        phase = "agree"
        held = [local for _, local in mine]
        if keep and outcome.error is None and not outcome.aborted:
            keep_regions(model, sinks)
            held = [model.get_parameter(sink.name).to_local() if isinstance(sink, KeepingSink) else local
                    for sink, local in zip(sinks, held, strict=False)]
        mismatch = None
        if verify and not outcome.aborted:  # an aborted node's shards are incomplete: nothing to verify
            mismatch = verify_regions(held, all_needs, capture, ep_plan=ep_plan, node=node,
                               compare=outcome.error is None)
        # Nobody leaves the init until everyone has its shards (and, with verify, they check out);
        # a source whose reading failed reports it here, to every rank.
        raise_init_together(outcome.error or mismatch, "memory_efficient_init")
        stats.collective_calls += 1
        finish(phase, t)
    except DistributedInitError as exc:
        board.failed(str(exc))
        raise
    except Exception as exc:  # noqa: BLE001 - a peer died or hung, or anything else: named from the board
        board.failed(f"{type(exc).__name__} during {phase}: {exc}", after_peer=stopped_by_peer(exc, topology.rank))
        raise _named_failure(board, phase, topology.rank, exc) from exc
    my_needs = [need for need, _ in mine]
    read = dict(bytes_read=capture.bytes_read, read_seconds=capture.read_seconds,
                whole_tensors=capture.whole_tensors) if capture is not None else {}
    return InitReport(
        rank=topology.rank, is_source=topology.is_source, seconds=time.perf_counter() - start,
        bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
        shard_bytes=sum(n.nbytes for n in my_needs if not n.is_buffer),
        buffer_bytes=sum(n.nbytes for n in my_needs if n.is_buffer), buckets=stats.buckets,
        collective_calls=stats.collective_calls, peak_rss_bytes=peak_rss_bytes(), tensors=len(my_needs),
        phase_seconds=phase_seconds, **read, **decoded_bytes(my_needs, all_needs, topology),
        **frozen_bytes(mine, my_forms, sinks, keep=keep), quantized_base=QuantizedBase(quantized_base).value,
    )


def _sink(need: Need, local, form, config, *, keep: bool):
    """Where a region's stream bytes go: its shard (values), a decoder into it, or (keep) kept as stored."""
    if form is None:
        return local
    if keep and need.rows is not None and not need.is_buffer:  # an FSDP2 shard, whose local tensor can be swapped
        return KeepingSink(need.name, local, form, config)
    return DecodingSink(local, form, config)


def _trainable_kept(model: nn.Module, mine, my_forms) -> str | None:
    """Why ``keep`` cannot serve this rank's regions: a quantized weight that training would change."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    for (need, _), form in zip(mine, my_forms, strict=False):
        if form is not None and need.name in trainable:
            return (f"quantized_base=keep: '{need.name}' is stored quantized in the release and is trainable, but "
                    "keep holds a frozen base; freeze it (train LoRA adapters over it) or set "
                    "quantized_base=dequantize")
    return None



def _named_failure(board: StatusBoard, phase: str, rank: int, exc: Exception) -> DistributedInitError:
    """The error this rank raises when a collective failed under it: which ranks failed (and why) or fell silent."""
    who, failures = board.who_stopped(phase)
    return DistributedInitError(f"memory_efficient_init failed on rank {rank} during '{phase}': {who}. "
                                f"Underlying error: {type(exc).__name__}: {exc}", failures)



def _as_values(all_needs, mine):
    """No region travels as stored (not a quantized release): every rank's forms are None, agreed without a word."""
    return [[None] * len(needs) for needs in all_needs or []], [None] * len(mine)


def _wire_forms(all_needs, capture, *, ep_plan: ExpertParallelPlan | None, node: NodeLink, bucket_bytes: int, stats):
    """The source decides which regions travel as stored (quantized) and tells each rank (None: as values).

    Returns every rank's forms (source; None elsewhere) and this rank's own.
    """
    forms = None
    if node.topology.is_source:
        forms = [[capture.wire_form(need, ep_plan, bucket_bytes) for need in needs] for needs in all_needs]
    mine = scatter_from_source(forms, node.topology.source_rank, node.group)
    stats.collective_calls += 1
    return forms, mine


def _plan(mine, capture, *, ep_plan: ExpertParallelPlan | None, node: NodeLink, stats) -> list[list[Need]] | None:
    """The source learns what each of its ranks needs and checks it can serve it; fail together."""
    topology = node.topology
    source, is_source = topology.source_rank, topology.is_source
    all_needs = gather_to_source([need for need, _ in mine], source, node.group)
    stats.collective_calls += 1
    error = None
    if is_source:
        for local_rank, needs in enumerate(all_needs):
            for need in needs:
                problem = check_need(need, capture.describe(need.name), ep_plan, source,
                                     dtype_reason=capture.dtype_reasons.get(need.name))
                if problem:
                    error = f"for local rank {local_rank} of node {topology.node_index}: {problem}"
                    break
            if error:
                break
    # A problem on any source stops every rank before any byte moves.
    raise_init_together(error, "memory_efficient_init")
    stats.collective_calls += 1
    return all_needs


def _transfer(mine, sinks, all_needs, *, forms, capture, ep_plan: ExpertParallelPlan | None, node: NodeLink,
              bucket_bytes, transport_kind, stats, show_progress) -> transport.Outcome:
    """Move the bytes inside the node, bucket by bucket; the source copies its own shards locally.

    ``sinks`` are this rank's shards, or decoders into them for regions that travel quantized.
    A failure to read on the source (file cut short or removed, bad tensor) does not leave its receivers
    waiting: it comes back in the outcome, for the fail-together step every rank reaches next.
    """
    is_source = node.topology.is_source
    chunk_bytes = max(bucket_bytes // READ_CHUNKS_PER_BUCKET, 1)
    writer = StreamWriter(sinks)
    readers = ([_reader(needs, rank_forms, capture=capture, ep_plan=ep_plan, chunk_bytes=chunk_bytes)
                for needs, rank_forms in zip(all_needs, forms, strict=False)] if is_source else None)
    progress = None
    if show_progress and is_source:
        from tqdm.auto import tqdm

        # Every byte of the node's shards: read (or viewed) on the source, then sent or kept.
        progress = tqdm(total=sum(r.total for r in readers), unit="B", unit_scale=True,
                        desc="memory_efficient_init: reading and sending shards")
    own = _copy_own_shards(mine, sinks, forms[0] if is_source else None, capture, ep_plan, chunk_bytes,
                           progress) if is_source else iter(())

    def copy_own(budget: int) -> None:
        # The source copies its own shards while the receivers' buckets are on the wire.
        done = 0
        for copied in own:
            done += copied
            if done >= budget:
                return

    outcome = transport.move_streams(transport_kind, readers, writer, node=node, bucket_bytes=bucket_bytes,
                                     stats=stats, progress=progress, between_rounds=copy_own)
    if is_source and outcome.error is None:
        try:
            for _ in own:  # what is left of the source's own shards
                pass
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
            outcome.error = exc
    if progress is not None:
        progress.set_postfix_str(progress_postfix(capture.bytes_read), refresh=False)  # close() draws it, once
        progress.close()
    if node.device.type != "cpu":
        torch.accelerator.synchronize()
    return outcome


def _copy_own_shards(mine, sinks, forms, capture, ep_plan: ExpertParallelPlan | None, chunk_bytes, progress):
    """Fill the source's own shards from what it holds or reads, a chunk at a time; yields bytes copied.
    A region kept as stored (``keep``) gets the stored bytes, as a receiver would."""
    for (need, local), sink, form in zip(mine, sinks, forms, strict=False):
        if isinstance(sink, KeepingSink):
            for chunk in capture.wire_chunks(need, form):
                sink.write(as_bytes(chunk))
                if progress is not None:
                    progress.update(chunk.numel() * chunk.element_size())
                yield chunk.numel() * chunk.element_size()
            continue
        rows_done = 0
        for chunk in capture.region_chunks(need, ep_plan, chunk_bytes):
            # no_grad per copy, not around the loop: grad mode is per thread, and this generator is
            # resumed by the sender's read thread and then by the main thread.
            with torch.no_grad():
                target = local.view(-1) if local.dim() == 0 else local[rows_done:rows_done + len(chunk)]
                target.copy_(chunk.reshape(target.shape))
            rows_done += len(chunk) if chunk.dim() else 0
            copied = chunk.numel() * chunk.element_size()
            del chunk, target  # not held while suspended: the sender's read thread reads meanwhile
            if progress is not None:
                progress.update(copied)
            yield copied



def _reader(needs: list[Need], forms: list, *, capture: Capture, ep_plan: ExpertParallelPlan | None,
            chunk_bytes: int) -> StreamReader:
    """A rank's stream: each region's values, or as stored where its wire form says so.

    No read-ahead thread per stream: the transport reads every stream in one thread, into its send pool.
    """
    regions = [(lambda need=need: capture.region_chunks(need, ep_plan, chunk_bytes)) if form is None
               else (lambda need=need, form=form: capture.wire_chunks(need, form))
               for need, form in zip(needs, forms, strict=False)]
    sizes = [need.nbytes if form is None else form.nbytes for need, form in zip(needs, forms, strict=False)]
    return StreamReader(regions, sizes)
