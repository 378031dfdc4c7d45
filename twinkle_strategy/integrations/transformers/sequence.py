"""Packed rows and Ulysses sequence parallelism in a ``transformers.Trainer``, served as twinkle's own Trainer serves them.

**Packed rows** (transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free`` / ``packing``, swift's
``--packing`` / ``--padding_free``): each micro-batch is one row whose ``position_ids`` restart at every example,
without an ``attention_mask``. transformers keeps each example's attention to itself from those positions, but only
when the model makes no KV cache: :func:`~twinkle_strategy.sequence.packed.prepare_for_packed_batches` refuses a family
whose layers would mix the examples and turns the cache off, at construction when the data collator says it
flattens, else before the first forward of such a batch (the same on every rank: the same collator, the same keys).

**Sequence parallelism** (``strategy.sequence_parallel_size`` = sp) has the ecosystem's meaning (accelerate's context
parallelism, ms-swift, torchtitan, and twinkle's own Trainer): the sp ranks of a group share their examples. The
train dataloader deals its batches over the data-parallel ranks (world / sp) instead of every rank
(:func:`share_examples_in_groups`), so the global batch is ``per_device_train_batch_size x
gradient_accumulation_steps x world / sp``; each rank then keeps its chunk of every row and the step core counts
``num_items_in_batch`` over the chunks (:class:`~twinkle_strategy.step.TrainingStep`). Every token of the
group's batch is computed once, by one rank, with the activations of a chunk.

Refused in one line, before the model is wrapped (so before any rank receives its weights): a loss that is not a
sum over tokens divided by ``num_items_in_batch`` (a model that does not take it, ``compute_loss_func``, label
smoothing: they would average or shift a chunk on its own), TRL's aux loss (added once per forward, so sp times per
micro-batch), and evaluation (its batches are not split). A batch key the split does not know is refused at the
first step, on every rank alike.
"""

from __future__ import annotations

from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.sequence.packed import PackingOption, prepare_for_packed_batches

# A refusal of packed rows in the words of transformers.Trainer and TRL.
TRAINER_PACKING = PackingOption(name="packed rows (DataCollatorWithFlattening, TRL's padding_free or packing)",
                                turn_off="use a padding data collator (TRL: SFTConfig(padding_free=False, "
                                         "packing=False))")

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
    if not getattr(args, "average_tokens_across_devices", True):
        raise ParallelConfigError(
            f"{prefix}: average_tokens_across_devices=False divides each chunk's loss by its own rank's tokens; set "
            "it to True (the default), or use sequence_parallel_size=1")
    strategy = getattr(args, "eval_strategy", "no")
    if getattr(strategy, "value", strategy) != "no":
        raise ParallelConfigError(
            f"{prefix}: evaluation is not split along the sequence yet; set eval_strategy='no', or use "
            "sequence_parallel_size=1")


def serve_sequences(trainer, strategy) -> PackedRows:
    """A trainer's :class:`PackedRows`, after refusing what sequence parallelism cannot serve (before wrapping)."""
    strategy.setup()
    if strategy.dims.sp_enabled:
        refuse_unserved(trainer, strategy.dims.sp_size)
    return PackedRows(packed=flattens(trainer.data_collator), model=trainer.model)


class PackedRows:
    """Packed rows need the model prepared once, before the first forward of one (``prepare`` each batch)."""

    def __init__(self, *, packed: bool, model) -> None:
        self._prepared = False
        if packed:
            self.prepare(model, None)

    def prepare(self, model, batch: dict | None) -> None:
        """Before the first forward of a packed batch (``batch`` None: the collator packs): refuse or turn the cache off."""
        if not self._prepared and (batch is None or is_flattened(batch)):
            prepare_for_packed_batches(model, option=TRAINER_PACKING)
            self._prepared = True


def share_examples_in_groups(dataloader, strategy):
    """``dataloader`` (prepared by accelerate, or swift's), its batches dealt over the data-parallel ranks: the ranks
    of a sequence-parallel group (consecutive ranks) draw the same examples. In place; returns it."""
    sp, dp_rank, dp_size = strategy.dims.sp_size, strategy.data_parallel_rank, strategy.data_parallel_size
    sampler = getattr(dataloader, "batch_sampler", None)
    while sampler is not None:
        if hasattr(sampler, "num_processes") and hasattr(sampler, "process_index"):  # accelerate's BatchSamplerShard
            sampler.num_processes, sampler.process_index = dp_size, dp_rank
            return dataloader
        if hasattr(sampler, "tp_size") and hasattr(sampler, "total_samples"):  # swift's: rank // tp_size share
            rows = sampler.total_samples * sampler.world_size  # the rows an epoch draws from, as without SP
            sampler.tp_size *= sp  # its world_size and rank read tp_size: the data-parallel ones
            sampler.total_samples = rows // sampler.world_size
            return dataloader
        sampler = getattr(sampler, "batch_sampler", None)  # accelerate's SkipBatchSampler (a resumed epoch)
    raise ParallelConfigError(
        f"sequence_parallel_size={sp}: the train dataloader draws its batches with "
        f"{type(getattr(dataloader, 'batch_sampler', dataloader)).__name__}, which cannot be told to give the ranks of "
        "a sequence-parallel group the same examples; use a dataset with a length (not an IterableDataset) and the "
        "trainer's own dataloader, or sequence_parallel_size=1")
