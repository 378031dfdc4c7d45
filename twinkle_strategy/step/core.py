"""The training step, the same for every front-end: twinkle's ``Trainer``, the ``transformers.Trainer`` mixin (and so
TRL's trainers and the ms-swift plugin).

A front-end hands over the micro-batches of one optimizer step as its data path collated them; :class:`TrainingStep`
then owns what makes the step's gradient the one a single process would compute on the whole global batch:

* **the split** (:meth:`TrainingStep.split`): under sequence parallelism every rank of a group holds the same
  micro-batches (the ecosystem's meaning, as accelerate's context parallelism, ms-swift and torchtitan: data-parallel
  size = world / sequence_parallel_size) and keeps its chunk of every row; packed rows stay one row, cut the same way;
* **the global token count** (:meth:`TrainingStep.global_tokens`): the loss tokens of every rank's chunks, each token
  counted once, the ``num_items_in_batch`` every forward divides its token-loss sum by;
* **the router pre-pass** (:meth:`TrainingStep.router_prepass`): with several forwards per step, the global-batch
  load-balancing loss needs the whole step's router counts before the first backward;
* **the forward** (:func:`.forward.forward_share`): replay, the aux-loss share, and what backward takes
  (:attr:`TrainingStep.loss_scale`: FSDP averages gradients over every rank, so each rank's share, its token-loss
  sum / the global count, is multiplied by the world size); twinkle's ``Trainer``, which runs its own backward,
  has the step core run them all (:meth:`TrainingStep.accumulate`), the ``transformers.Trainer`` mixin calls the
  forward from ``compute_loss``;
* **clipping** (:meth:`TrainingStep.clip`) over the expert and the non-expert meshes;
* **metrics** (:attr:`TrainingStep.metrics`, :mod:`.metrics`): tokens, throughput and the expert load of each log
  line.

What a front-end keeps: its loop or HF's, its logging and saving; resuming is :mod:`.resume`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from twinkle_strategy.errors import ModelStructureError, ParallelConfigError
from twinkle_strategy.moe.balance import GlobalBatchAuxLoss, RouterStats
from twinkle_strategy.moe.discovery import find_moe_blocks
from twinkle_strategy.moe.flops import FlopsModel, device_peak_tflops, throughput
from twinkle_strategy.moe.load import ExpertLoad
from twinkle_strategy.sequence.batch import ROUTED_EXPERTS, loss_token_count
from twinkle_strategy.step.collectives import all_reduce_sum, any_rank
from twinkle_strategy.step.forward import forward_share
from twinkle_strategy.step.metrics import StepMetrics

logger = logging.getLogger(__name__)

# What the sequence split cuts (sequence.split_batch; it adds the shifted labels).
SPLIT_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids", ROUTED_EXPERTS})
# What flattening collators add to describe the whole row for flash attention (TRL, transformers): not a chunk's.
# The Ulysses attention finds the examples from the gathered global position ids instead.
WHOLE_ROW_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPolicy:
    """How every front-end takes a step. ``max_grad_norm``: the clipping threshold (``inf``: measure, never clip).
    ``peak_tflops``: the device's peak for ``mfu`` (None: the known peak of the device, if any)."""

    max_grad_norm: float
    peak_tflops: float | None = None


@dataclasses.dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches of one optimizer step."""

    tensors: list[dict[str, torch.Tensor]]  # as the model takes them (under sequence parallelism: the rank's chunks)


@dataclasses.dataclass(frozen=True)
class TokenCounts:
    """A step's tokens over every rank: those its loss is taken over, and the non-padding input tokens. Both stay
    on the device (a step reads neither on the host: a log line does, if it needs them)."""

    loss: torch.Tensor  # int64 on the device: pass as num_items_in_batch
    inputs: torch.Tensor  # int64 on the device


@dataclasses.dataclass(frozen=True)
class StepGradients:
    """What :meth:`TrainingStep.accumulate` leaves besides the gradients: this rank's sums of the loss and aux-loss
    shares (fp32 on the device, not yet summed over ranks), and the step's token counts."""

    shares: torch.Tensor  # [loss, aux loss]: this rank's; summed over every rank, the step's global losses
    tokens: TokenCounts


# A front-end's training forward of a chunk: (its loss share, its outputs) with the step's global loss-token count.
ChunkForward = Callable[[dict, torch.Tensor], tuple[torch.Tensor, Any]]


def expert_load_or_none(model: nn.Module, *, ep_size: int) -> ExpertLoad | None:
    """Expert-load counting for an MoE model whose experts call we know; None otherwise (dense models, and
    families EP refuses, which still train with ep_size=1 but log no moe_load_imbalance)."""
    try:
        return ExpertLoad(model, ep_size=ep_size) if find_moe_blocks(model) else None
    except ModelStructureError as exc:
        logger.warning("no expert-load statistics: %s", exc)
        return None


def real_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens of a collated batch (a flattened batch has no padding)."""
    return int(real_tokens(batch))


def real_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`real_token_count` as an int64 scalar on the batch's device, without a host sync."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return torch.as_tensor(mask).sum().long()
    ids = torch.as_tensor(batch["input_ids"])
    return torch.full((), ids.numel(), dtype=torch.long, device=ids.device)  # a fill, not a copy from the host


def left_padded(batch: dict) -> bool:
    """Whether a row of ``batch`` has padding before a real token (its attention mask rises again after a 0)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return False
    return bool((mask[:, 1:] > mask[:, :-1]).any())


class TrainingStep:
    """The step core of one model trained through ``strategy`` (wrapped or about to be: the counters hook the
    experts' modules, which wrapping keeps). ``balancing``: the global-batch load-balancing loss, if any."""

    def __init__(self, strategy, model: nn.Module, *, policy: StepPolicy,
                 balancing: GlobalBatchAuxLoss | None = None, ep_size: int | None = None) -> None:
        strategy.setup()
        self.strategy = strategy
        self.policy = policy
        self.balancing = balancing
        ep_size = strategy.ep_size if ep_size is None else ep_size
        self.expert_load = expert_load_or_none(model, ep_size=ep_size)
        self._model = model
        self.peak_tflops = policy.peak_tflops or device_peak_tflops(strategy.device)
        self.metrics = StepMetrics(self)  # the log lines' tokens, throughput and expert load

    @functools.cached_property
    def flops(self) -> FlopsModel:
        """The model's FLOPs per token, as wrapped (on first use: the model may be wrapped after the core is built)."""
        return FlopsModel.of(self._model, ep_size=self.strategy.ep_size)

    @property
    def sequence_parallel(self) -> int:
        return self.strategy.dims.sp_size

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def loss_scale(self) -> int:
        """What each rank's loss share is multiplied by before backward: FSDP averages gradients over every rank,
        and the shares (token-loss sums / the global count) add up over ranks to the global per-token mean."""
        return self.strategy.world_size

    def split(self, batches: list[dict]) -> StepBatches:
        """This rank's chunk of each of the step's micro-batches (each itself without sequence parallelism), on the
        device. Under sequence parallelism the group's ranks pass the same batches (refusals: on every rank alike)."""
        if self.sequence_parallel > 1:
            self._refuse_unsplittable(batches)
        device = self.strategy.device
        # CUDA: a blocking copy from the host waits for the device's queue to drain (a host sync at every step's
        # start); a non-blocking one from pageable memory is staged at once and waits for nothing.
        non_blocking = device.type == "cuda"
        tensors = []
        for batch in batches:
            batch = {k: torch.as_tensor(v).to(device, non_blocking=non_blocking) for k, v in batch.items()
                     if v is not None and not (self.sequence_parallel > 1 and k in WHOLE_ROW_KEYS)}
            tensors.append(self.strategy.split_sequence(batch))
        return StepBatches(tensors=tensors)

    def _refuse_unsplittable(self, batches: list[dict]) -> None:
        sp = self.sequence_parallel
        unknown = sorted({k for batch in batches for k, v in batch.items() if v is not None} - SPLIT_KEYS
                         - WHOLE_ROW_KEYS)
        if unknown:  # the same keys on the group's ranks (the same batches): each raises here, before a collective
            raise ParallelConfigError(
                f"sequence_parallel_size={sp} cannot split the batch key(s) {unknown} along the sequence (it splits "
                f"{sorted(SPLIT_KEYS)}); drop them from the data collator's output, or use sequence_parallel_size=1")
        # Rows padded on the left would let real tokens attend to the padding before them (the split keeps
        # attention causal, with no padding mask): refused on every rank at once, whichever rank holds one. The
        # batches are as collated (host tensors in twinkle's Trainer): the check reads them there and the ranks
        # agree on the host (any_rank), so the step never waits for the device to answer.
        if any_rank(any(left_padded(batch) for batch in batches), timeout_s=self.strategy.timeout_s):
            raise ParallelConfigError(f"sequence_parallel_size={sp} needs rows padded on the right; a batch of this "
                                      "step is padded on the left: set the tokenizer's padding_side='right' (or the "
                                      "data collator's), or use sequence_parallel_size=1")

    def global_tokens(self, chunks: list[dict]) -> TokenCounts:
        """The step's loss and input tokens over every rank (collective): each token once, whichever rank's chunk
        holds it. Counted on the device and left there (int64: exact past 2**24 tokens): no host sync."""
        device = self.strategy.device
        sizes = torch.zeros(2, dtype=torch.long, device=device)
        for chunk in chunks:
            sizes += torch.stack([loss_token_count(chunk).to(device), real_tokens(chunk).to(device)])
        loss, inputs = all_reduce_sum(sizes)
        return TokenCounts(loss=loss, inputs=inputs)

    def router_prepass(self, model: nn.Module, chunks: list[dict]) -> RouterStats | None:
        """The global router statistics of the step's forwards (collective, one gradient-free forward each), or None
        when the first forward's own statistics serve (one forward per step) or no global aux loss is taken."""
        if self.balancing is None or len(chunks) <= 1:
            return None
        model.train()
        return self.balancing.prepass(model, iter(chunks), expert_load=self.expert_load,
                                      replay_of=self.strategy.replay_of_batch)

    def accumulate(self, model: nn.Module, collated: list[dict], *, forward: ChunkForward) -> StepGradients:
        """Forward and backward of every micro-batch of a step, for a front-end that runs its own backward (twinkle's
        ``Trainer``): ``collated``, this rank's micro-batches as collated (whole rows), are counted for the metrics,
        split, their loss tokens counted over every rank, the router pre-passed; then each chunk's
        :func:`.forward.forward_share` (``forward``: the front-end's, given the chunk and the global token count)
        and its backward. Collective."""
        for batch in collated:
            self.metrics.observe(batch)  # whole rows, before the split
        chunks = self.split(collated).tensors
        tokens = self.global_tokens(chunks)
        router = self.router_prepass(model, chunks)  # several chunks: the global router counts before any backward
        model.train()
        shares = torch.zeros(2, device=self.device)
        for chunk in chunks:
            self.count_tokens_of(chunk)
            share = forward_share(model, chunk, forward=lambda batch: forward(batch, tokens.loss),
                                  replay_of=self.strategy.replay_of_batch, balancing=self.balancing, router=router)
            share.objective(loss_scale=self.loss_scale).backward()
            router = share.router
            shares += torch.stack([share.loss.detach(), share.aux_or_zero.detach()])
        return StepGradients(shares=shares, tokens=tokens)

    def clip(self, model: nn.Module, max_norm: float | None = None) -> torch.Tensor:
        """Clip every gradient to ``max_norm`` (the policy's by default) over every mesh; the norm before."""
        return self.strategy.clip_grad_norm_(model, self.policy.max_grad_norm if max_norm is None else max_norm)

    def count_tokens_of(self, batch: dict) -> None:
        """Before a training forward: keep padding out of the expert load."""
        if self.expert_load is not None:
            self.expert_load.token_mask = batch.get("attention_mask")

    def take_expert_counts(self) -> torch.Tensor | None:
        """The [layers, experts] router choices since the last call, over every rank (collective); None: not MoE."""
        return self.expert_load.take_global() if self.expert_load is not None else None

    def throughput(self, *, tokens: float, seq_len: float, seconds: float) -> dict[str, float]:
        """tokens_per_second, tflops_per_device and (on a device with a known peak) mfu, for ``tokens`` global
        non-padding tokens trained in ``seconds``."""
        return throughput(self.flops, tokens=tokens, seq_len=seq_len, seconds=seconds,
                          world_size=self.strategy.world_size, peak_tflops=self.peak_tflops)
