"""swift's ``--packing``, ``--padding_free`` and ``--sequence_parallel_size``, served by the shared transformers layer.

* **Packed rows** stay swift's: its template packs (``--packing``) or concatenates (``--padding_free``) each
  micro-batch into one row whose ``position_ids`` restart at every example. swift asks for flash attention there
  because it builds no mask; transformers builds the per-example causal mask for sdpa, eager and flex from those
  positions when the model makes no KV cache, which the plugin turns off, refusing a family whose layers would mix
  the examples (:func:`~twinkle_strategy.sequence.packed.prepare_for_packed_batches`) before any weight is read.
* **Sequence parallelism** is the strategy's (Ulysses over its own meshes), not swift's: ``--sequence_parallel_size``
  becomes the strategy's ``sequence_parallel_size`` and swift's own is set back to 1, so swift builds none of its
  process groups, samplers or loss gathers. swift's data path stays per rank, and the transformers layer
  (:mod:`twinkle_strategy.integrations.transformers.sequence`) exchanges and splits the batches. What swift then
  computes on a chunk is adjusted here: the loss is summed over the chunk's tokens and divided by
  ``num_items_in_batch`` (swift's own scales a per-chunk mean by a count taken after one more shift), token
  accuracy reads the chunk's labels as already shifted, and ``logits_to_keep`` is off (it would compact ``labels``
  but not the chunk's ``shift_labels``). What it cannot serve is refused with the flag, before the model loads.
"""

from __future__ import annotations

import types

import torch.nn.functional as F

from twinkle_strategy.integrations.swift.errors import SwiftPluginError

FLASH_ATTENTION = ("flash_attn", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def check_padding_free(orig, self) -> None:
    """Hook of ``SftArguments._check_padding_free``: packed rows need no flash attention with the plugin."""
    if (self.packing or self.padding_free) and self.attn_impl not in FLASH_ATTENTION:
        self.padding_free = True  # as swift does: packing collates padding-free rows
        return
    orig(self)


def take_sequence_parallel(args, *, option: int | None = None) -> int:
    """``--sequence_parallel_size`` (or the plugin option ``sequence_parallel_size``) for the strategy, swift's own set
    back to 1; refuses what it cannot serve."""
    sp = int(getattr(args, "sequence_parallel_size", 1) or 1)
    if option is not None and option != sp:
        if sp != 1:
            raise SwiftPluginError(f"--sequence_parallel_size {sp} and the plugin option sequence_parallel_size={option} "
                                   "disagree; pass one of them (--sequence_parallel_size is swift's flag)")
        sp = option
    if sp == 1:
        return 1
    for flag, on, fix in _unserved(args):
        if on:
            raise SwiftPluginError(f"--sequence_parallel_size {sp} with {flag}: {fix}, or --sequence_parallel_size 1")
    args.sequence_parallel_size = 1  # swift builds no sequence-parallel groups of its own next to the strategy's
    args.use_logits_to_keep = False  # it would compact labels, not the chunk's shift_labels
    return sp


def _unserved(args) -> list[tuple[str, bool, str]]:
    """(flag, set, fix) for each swift option that would compute a chunk's loss on its own terms."""
    evaluates = bool(getattr(args, "val_dataset", None)) or (getattr(args, "split_dataset_ratio", 0) or 0) > 0
    return [
        (f"--loss_type {getattr(args, 'loss_type', None)}", getattr(args, "loss_type", None) is not None,
         "a custom loss shifts a chunk's labels again; drop --loss_type"),
        ("--label_smoothing_factor", bool(getattr(args, "label_smoothing_factor", 0)),
         "label smoothing shifts a chunk's labels again; set it to 0"),
        ("--enable_dft_loss true", bool(getattr(args, "enable_dft_loss", False)), "drop it"),
        ("--enable_channel_loss true", bool(getattr(args, "enable_channel_loss", False)), "drop it"),
        (f"--router_aux_loss_coef {getattr(args, 'router_aux_loss_coef', 0)}",
         (getattr(args, "router_aux_loss_coef", 0) or 0) > 0,
         "swift adds the aux loss once per forward, so once per chunk; set it to 0"),
        ("--use_logits_to_keep true", getattr(args, "use_logits_to_keep", None) is True,
         "it would compact the labels but not the chunk's shift_labels; drop it"),
        ("--acc_strategy seq", getattr(args, "acc_strategy", "token") == "seq",
         "a chunk holds parts of sequences; use --acc_strategy token"),
        ("--padding_side left", getattr(args, "padding_side", "right") == "left",
         "the split keeps padding at the end of a row; use --padding_side right"),
        ("evaluation (--val_dataset or --split_dataset_ratio)", evaluates and getattr(args, "eval_strategy", "no") != "no",
         "evaluation is not split along the sequence yet; drop the validation set or pass --eval_strategy no"),
    ]


def chunk_sft_loss(template, model, inputs, num_items_in_batch=None, trainer=None):
    """swift's SFT loss on a sequence-parallel chunk: the sum over its tokens / ``num_items_in_batch``.

    swift's own (``Template.compute_sft_loss``) takes the model's mean and multiplies it by the tokens of
    ``labels[:, 1:]``: on a chunk that mean is over its ``shift_labels`` (NaN where it has none, e.g. a prompt) and
    the count drops its first label, which the shift already placed."""
    return model(**inputs, num_items_in_batch=num_items_in_batch)


def serve_chunks(trainer) -> None:
    """Under the strategy's sequence parallelism, point swift's trainer at :func:`chunk_sft_loss` (every rank)."""
    from swift.template import Template

    template = trainer.template
    if type(template).compute_sft_loss is not Template.compute_sft_loss:
        raise SwiftPluginError(f"--sequence_parallel_size with --template {getattr(template, 'template_type', '?')}: "
                               f"{type(template).__name__} computes its own SFT loss, which sequence parallelism "
                               "cannot split; use --sequence_parallel_size 1")
    template.compute_sft_loss = types.MethodType(chunk_sft_loss, template)


def chunk_accuracy_inputs(outputs, labels):
    """(outputs, labels) for swift's token accuracy on a chunk: swift shifts ``labels`` against the predictions, a
    chunk's labels are shifted already, so both get one position: a label in front, a prediction at the end."""
    padded = types.SimpleNamespace(logits=F.pad(outputs.logits, (0, 0, 0, 1)))
    return padded, F.pad(labels, (1, 0), value=-100)
