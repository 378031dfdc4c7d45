"""Packed rows and Ulysses sequence parallelism in a ``transformers.Trainer``, served as twinkle's own Trainer serves them.

**Packed rows** (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free`` / ``packing``, swift's
``--packing`` / ``--padding_free``): each micro-batch is one row whose ``position_ids`` restart at every example,
without an ``attention_mask``. transformers keeps each example's attention to itself from those positions, but only
when the model makes no KV cache: :func:`~twinkle_strategy.sequence.packed.prepare_for_packed_batches` refuses a family
whose layers would mix the examples and turns the cache off, at construction when the data collator says it
flattens, else before the first forward of such a batch (the same on every rank: the same collator, the same keys).

**Sequence parallelism** (``strategy.sequence_parallel_size`` = sp): accelerate's data path stays as it is, each
rank gets its own micro-batches, so the global batch, the steps and HF's ``num_items_in_batch`` are those of the
run without SP. The sp ranks of a group exchange their micro-batches (an all-gather on the backend's device), and
each rank runs forward and backward on its chunk of each of them in turn
(:func:`~twinkle_strategy.sequence.split_batch`: global position ids, labels shifted on the whole row), with the
``num_items_in_batch`` of the rank the batch came from. Every token of the group's batches is computed once, by
one rank, with the activations of a chunk; the chunks' losses add up to the loss of the run without SP, which is
also what HF logs. The global-batch aux loss sees every chunk of the step in its pre-pass.

Refused in one line, before the model is wrapped (so before any rank receives its weights): a loss that is not a
sum over tokens divided by ``num_items_in_batch`` (a model that does not take it, ``compute_loss_func``, label
smoothing: they would average or shift a chunk on its own), TRL's aux loss (added once per forward, so sp times per
micro-batch), and evaluation (its batches are not split). A batch key the split does not know is refused at the
first step, on every rank alike.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.sequence.packed import PackingOption, prepare_for_packed_batches

# A refusal of packed rows in the words of transformers.Trainer and TRL.
TRAINER_PACKING = PackingOption(name="packed rows (DataCollatorWithFlattening, TRL's padding_free or packing)",
                                turn_off="use a padding data collator (TRL: SFTConfig(padding_free=False, "
                                         "packing=False))")

# What split_batch cuts (and the shifted labels it adds).
_SPLIT_KEYS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
# What flattening collators add to describe the whole row for flash attention (TRL, transformers): not a chunk's.
# Ulysses finds the examples from the gathered global position ids instead.
_WHOLE_ROW_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})


def flattens(data_collator) -> bool:
    """Whether ``data_collator`` gives packed rows (one row per micro-batch, position ids restarting per example)."""
    from transformers import DataCollatorWithFlattening

    if isinstance(data_collator, DataCollatorWithFlattening):
        return True
    owner = getattr(data_collator, "__self__", data_collator)  # swift's collator is its template's bound method
    return bool(getattr(owner, "padding_free", False))  # TRL's collator, swift's template (packing sets it too)


def is_flattened(batch: dict) -> bool:
    """A packed batch: position ids and no attention mask (transformers then reads the examples from the positions)."""
    return "position_ids" in batch and "attention_mask" not in batch


def left_padded(batch: dict) -> bool:
    """Whether a row of ``batch`` has padding before a real token (its attention mask rises again after a 0)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return False
    return bool((mask[:, 1:] > mask[:, :-1]).any())


def refuse_unserved(trainer, sp: int) -> None:
    """What a trainer under sequence parallelism cannot serve, in one line naming the setting and the fix."""
    args = trainer.args
    name = type(trainer).__name__
    prefix = f"sequence_parallel_size={sp} with {name}"
    if not trainer.model_accepts_loss_kwargs and trainer.compute_loss_func is None:
        raise ParallelConfigError(
            f"{prefix}: the model's forward takes no num_items_in_batch, so each chunk's loss would be a mean over "
            "the chunk alone; use a model whose forward takes **kwargs (every transformers causal LM), or "
            "sequence_parallel_size=1")
    if trainer.compute_loss_func is not None:
        raise ParallelConfigError(
            f"{prefix}: compute_loss_func would receive a chunk's labels, already shifted on the whole row, and shift "
            "them again; drop compute_loss_func, or use sequence_parallel_size=1")
    if getattr(args, "label_smoothing_factor", 0):
        raise ParallelConfigError(
            f"{prefix}: label_smoothing_factor={args.label_smoothing_factor} shifts a chunk's labels again; set it to "
            "0, or use sequence_parallel_size=1")
    if getattr(trainer, "aux_loss_enabled", False):  # TRL's trainers add theirs once per forward
        raise ParallelConfigError(
            f"{prefix}: TRL adds the router aux loss once per forward, so sp times per micro-batch here; pass "
            "router_aux_loss_coef=0 to the TRL config (or use transformers.Trainer, where the global-batch aux loss "
            "is served), or sequence_parallel_size=1")
    strategy = getattr(args, "eval_strategy", "no")
    if getattr(strategy, "value", strategy) != "no":
        raise ParallelConfigError(
            f"{prefix}: evaluation is not split along the sequence yet; set eval_strategy='no', or use "
            "sequence_parallel_size=1")


def serve_sequences(trainer, strategy) -> SequenceBatches:
    """A trainer's :class:`SequenceBatches`, after refusing what sequence parallelism cannot serve (before wrapping)."""
    strategy.setup()
    if strategy.dims.sp_enabled:
        refuse_unserved(trainer, strategy.dims.sp_size)
    return SequenceBatches(strategy, packed=flattens(trainer.data_collator), model=trainer.model)


class SequenceBatches:
    """A trainer's packed and sequence-parallel batches: ``prepare`` each batch, run ``forwards`` of each."""

    def __init__(self, strategy, *, packed: bool, model) -> None:
        self.strategy = strategy  # set up (serve_sequences)
        self.sp = strategy.dims.sp_size
        self.device = strategy.device
        self._packed = False
        self._chunks: dict[int, list[tuple[dict, torch.Tensor | None]]] = {}  # id(micro-batch) -> its forwards
        if packed:
            self.prepare(model, None)

    @property
    def enabled(self) -> bool:
        return self.sp > 1

    def prepare(self, model, batch: dict | None) -> None:
        """Before the first forward of a packed batch (``batch`` None: the collator packs): refuse or turn the cache off."""
        if not self._packed and (batch is None or is_flattened(batch)):
            prepare_for_packed_batches(model, option=TRAINER_PACKING)
            self._packed = True

    def step(self, batch_samples: list[dict], num_items) -> list[dict]:
        """Exchange and split a step's micro-batches (collective); every forward of the step, in order."""
        # Rows padded on the left would let real tokens attend to the padding before them (the split keeps
        # attention causal, with no padding mask): refused on every rank at once, whichever rank holds one.
        left = torch.tensor(float(any(left_padded(batch) for batch in batch_samples)), device=self.device)
        dist.all_reduce(left, op=dist.ReduceOp.MAX)
        if left.item():
            raise ParallelConfigError(f"sequence_parallel_size={self.sp} needs rows padded on the right; a batch of "
                                      "this step is padded on the left: set the tokenizer's padding_side='right' "
                                      "(or the data collator's), or use sequence_parallel_size=1")
        self._chunks = {id(batch): self._split(batch, num_items) for batch in batch_samples}
        return [chunk for forwards in self._chunks.values() for chunk, _ in forwards]

    def forwards(self, batch: dict, num_items) -> list[tuple[dict, torch.Tensor | None]]:
        """This rank's chunk of each group member's ``batch``, with that member's ``num_items_in_batch``."""
        found = self._chunks.pop(id(batch), None)
        return found if found is not None else self._split(batch, num_items)

    def _split(self, batch: dict, num_items) -> list[tuple[dict, torch.Tensor | None]]:
        batch = {k: v for k, v in batch.items() if v is not None and k not in _WHOLE_ROW_KEYS}
        unknown = sorted(set(batch) - _SPLIT_KEYS)
        if unknown:  # the same keys on every rank (one collator): every rank raises here, before any collective
            raise ParallelConfigError(
                f"sequence_parallel_size={self.sp} cannot split the batch key(s) {unknown} along the sequence (it "
                f"splits {sorted(_SPLIT_KEYS)}); drop them from the data collator's output, or use "
                "sequence_parallel_size=1")
        batch = {k: torch.as_tensor(v).to(self.device) for k, v in batch.items()}
        count = None if num_items is None else torch.as_tensor(num_items, device=self.device)
        members = gather_batches({**batch, **({} if count is None else {"num_items": count.reshape(1)})},
                                 self.strategy.meshes.sp_group)
        return [(self.strategy.split_sequence({k: v for k, v in member.items() if k != "num_items"}),
                 None if count is None else member["num_items"].reshape(()).to(count.dtype))
                for member in members]


def gather_batches(batch: dict[str, torch.Tensor], group) -> list[dict[str, torch.Tensor]]:
    """Every group member's ``batch`` (same keys and dimensions everywhere, any sizes), in group rank order.

    Two ``all_gather_into_tensor`` calls per key plus one for the shapes, on the tensors' device (NCCL and HCCL
    have it): the shapes first, then each tensor flattened and padded to the longest.
    """
    size = dist.get_world_size(group)
    names = sorted(batch)
    device = batch[names[0]].device
    shape = torch.tensor([d for name in names for d in batch[name].shape], dtype=torch.long, device=device)
    shapes = shape.new_empty(size * shape.numel())
    dist.all_gather_into_tensor(shapes, shape, group=group)
    shapes = shapes.view(size, -1).tolist()
    members: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    at = 0
    for name in names:
        tensor = batch[name]
        dims = tensor.dim()
        member_shapes = [row[at:at + dims] for row in shapes]
        at += dims
        longest = max(math.prod(s) for s in member_shapes)
        flat = tensor.reshape(-1)
        stored = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # collectives on bool vary by backend
        stored = F.pad(stored, (0, longest - flat.numel()))
        gathered = stored.new_empty(size * longest)
        dist.all_gather_into_tensor(gathered, stored.contiguous(), group=group)
        for member, member_shape, piece in zip(members, member_shapes, gathered.view(size, longest), strict=True):
            member[name] = piece[:math.prod(member_shape)].view(member_shape).to(tensor.dtype)
    return members
