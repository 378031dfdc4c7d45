"""Any ``transformers.Trainer`` (TRL's ``SFTTrainer``, ms-swift's trainers) training through NativeFSDPStrategy.

    strategy = NativeFSDPStrategy(ep_size=2, memory_efficient_init=True)
    model = strategy.from_pretrained("Qwen/Qwen3-30B-A3B")       # no rank holds the whole model
    model = get_peft_model(model, lora_config)                     # optional (or SFTTrainer's peft_config=)
    trainer = with_strategy(SFTTrainer)(model=model, args=args, strategy=strategy, train_dataset=...)
    trainer.train()

Why a mixin, not a ``TrainingArguments`` switch: the trainer must answer a few of its own hooks
differently (gradient clipping, saving, resuming), which only a subclass can do without patching
transformers for the whole process; and a mixin placed first in the MRO composes with every
``Trainer`` subclass without knowing it (TRL's, swift's, a user's). :func:`~.classes.with_strategy` builds the
class for a given trainer class.

What changes, and why:

* The model is wrapped (EP, then FSDP2, and with memory_efficient_init each rank receives its
  shards from its node's source) once the trainer class has finished building it, so that
  TRL's ``peft_config`` is applied to the whole, un-split model first.
* On a CPU strategy, transformers and TRL count every rank without ``use_cpu=True`` (:mod:`.cpu`).
* accelerate sees a prepared model: no DDP, no FSDP plugin, no ``cpu_ram_efficient_loading``
  broadcast from rank 0. Settings that would shard again are refused in one line
  (:mod:`.refusals`). The data stays accelerate's: each data-parallel rank its own part of every global batch.
* Gradient norms and clipping span the expert and non-expert meshes.
* Where the model adds its own load-balancing loss (``output_router_logits`` and
  ``router_aux_loss_coef > 0``), or TRL's trainers add it (on by default, with the model's
  coefficient), its token fractions are counted over the global batch (every rank, every
  micro-batch of the step), as twinkle's own Trainer does (:mod:`.aux_loss`).
* The step is the one every front-end takes (:class:`~twinkle_strategy.step.TrainingStep`): the sequence
  split, the global token count, the router pre-pass, the loss scale, clipping, the expert load.
* Packed rows (``DataCollatorWithFlattening``, TRL's ``padding_free``) keep each example's attention to itself,
  and ``strategy.sequence_parallel_size`` splits every sequence over a group of ranks that share their examples,
  as twinkle's own Trainer does: the global batch is ``per_device_train_batch_size x gradient_accumulation_steps x
  world / sequence_parallel_size``; what cannot be served so is refused in one line (:mod:`.sequence`).
* Log lines keep HF's fields and add the step's: ``tokens``, ``tokens_per_second``, ``flops_per_token``,
  ``tflops_per_device``, ``mfu`` (on a device with a known peak) and ``moe_load_imbalance``, the same fields as
  twinkle-sft's from the same counts (:mod:`twinkle_strategy.step.metrics`).
* Log lines also go to ``output_dir/logging.jsonl``, as twinkle-sft's, and when training ends process zero prints
  where the results are: the output directory, the last checkpoint, the log file (:mod:`.run_log`).
* Saves write the model as a Hugging Face checkpoint from every rank (a LoRA run: the full
  adapter in PEFT's format), and ``trainer_state/`` by full tensor: a run resumes on another
  number of nodes, ranks or ep_size (:mod:`twinkle_strategy.checkpoint.training`). With
  ``async_save=True`` they are written in the background while training goes on (:mod:`.async_save`): the
  same kinds of save, declared once (:mod:`twinkle_strategy.checkpoint.training`), carried out by the same executor.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint.save_plan import FrontEndFiles, save_items
from twinkle_strategy.checkpoint.training import (
    SaveKind,
    SaveSources,
    declare,
    model_kind,
    save_pretrained,
)
from twinkle_strategy.compat.transformers_internals import (
    file_size_bytes,
    mark_accelerate_prepared,
    parent_save_checkpoint,
    trainer_prepare_inputs,
)
from twinkle_strategy.errors import ParallelConfigError, ResumeError
from twinkle_strategy.integrations.transformers.async_save import AsyncCheckpoints, refuse_unserved
from twinkle_strategy.integrations.transformers.aux_loss import share_scale, take_over_aux_loss
from twinkle_strategy.integrations.transformers.cpu import serve_cpu
from twinkle_strategy.integrations.transformers.refusals import (
    naming_unknown_keywords,
    refuse_conflicting_sharding,
    refuse_transformers_expert_parallel,
)
from twinkle_strategy.integrations.transformers.run_log import RunLog
from twinkle_strategy.integrations.transformers.sequence import serve_sequences, share_examples_in_groups
from twinkle_strategy.moe.balance import RouterStats
from twinkle_strategy.moe.recompute import replay_in_transformers_checkpointing
from twinkle_strategy.step import StepPolicy, TrainingStep
from twinkle_strategy.step.forward import forward_share
from twinkle_strategy.step.resume import restore_trainer_state, restore_weights
from twinkle_strategy.strategy import NativeFSDPStrategy

logger = logging.getLogger(__name__)

SAVE_PRETRAINED_SHARD_SIZE = "5GB"  # what save_model writes with (NativeFSDPStrategy.save_pretrained's default)


class StrategyTrainerMixin:
    """Placed before a ``transformers.Trainer`` subclass: trains the model through ``strategy``."""

    # The model's own load-balancing loss is replaced by the global-batch one; False for trainer classes that
    # set the model's coefficient and add the loss themselves (swift's).
    replaces_model_aux_loss = True
    # Where a trainer logs the global-batch aux loss, its training forwards' shares (.aux_loss.GlobalAuxLossWindow).
    aux_loss_window = None
    # Whether the trainer writes output_dir/logging.jsonl and prints where its results are at the end (.run_log);
    # False for trainer classes that do so themselves (swift's).
    writes_run_log = True

    def __init__(self, *args, strategy: NativeFSDPStrategy, async_save: bool = False, **kwargs) -> None:
        """``async_save``: save checkpoints in the background, training waiting only while each rank copies its
        share to host memory (:mod:`.async_save`; off by default until it has run a release on a cluster)."""
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse_conflicting_sharding(training_args)  # before the trainer class does anything with the model
        refuse_transformers_expert_parallel(kwargs.get("model", args[0] if args else None))
        if async_save:
            refuse_unserved(training_args)
        serve_cpu(training_args, strategy)  # a CPU run: transformers and TRL see every rank (.cpu)
        self.strategy = strategy
        with naming_unknown_keywords(type(self), kwargs):  # a misspelt keyword: one line naming the closest
            super().__init__(*args, **kwargs)
        # Packed rows and sequence parallelism (.sequence): refusals before any rank receives its weights.
        self.packed_rows = serve_sequences(self, strategy)
        self._wrap_with_strategy()
        self.async_checkpoints = None
        if async_save:
            self.async_checkpoints = AsyncCheckpoints(self, pin_memory=self.strategy.device.type != "cpu")
            self.add_callback(self.async_checkpoints)
        if self.writes_run_log:  # after the asynchronous saves: the last one is complete when the end is printed
            self.add_callback(RunLog())

    def _wrap_with_strategy(self) -> None:
        prepare_for_trainer(self.strategy, self.model)  # in place: the trainer's references stay valid
        self.model_wrapped = self.model
        # The model's (or TRL's) load-balancing loss, counted over the global batch instead (.aux_loss).
        self.global_aux_loss = take_over_aux_loss(self, self.model) if self.replaces_model_aux_loss else None
        self.step_core = TrainingStep(self.strategy, self.model, balancing=self.global_aux_loss,
                                      policy=StepPolicy(max_grad_norm=self.args.max_grad_norm))
        self.step_metrics = self.step_core.metrics
        self._step_router_stats: RouterStats | None = None  # of the current step's micro-batches, over every rank

    # Whether the dataloader's batches are the model's inputs. GRPO's are prompts, turned into model inputs by its
    # own _prepare_inputs (generation), which observes them there (integrations/transformers/grpo.py).
    batches_are_model_inputs = True

    @property
    def sequence_parallel(self) -> bool:
        """Whether each rank trains on its chunk of rows its sequence-parallel group shares."""
        return self.strategy.dims.sp_enabled

    # -- the data: under sequence parallelism a group's ranks draw the same examples
    def get_train_dataloader(self, *args, **kwargs):
        dataloader = super().get_train_dataloader(*args, **kwargs)
        return share_examples_in_groups(dataloader, self.strategy) if self.sequence_parallel else dataloader

    # -- the model's load-balancing loss over the global batch
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.batches_are_model_inputs:
            for batch in batch_samples:
                self.packed_rows.prepare(self.model, batch)
                self.step_metrics.observe(batch)  # whole rows, before the split
        self._step_router_stats = None
        if self.sequence_parallel:  # this rank's chunk of each shared micro-batch; the tokens over every chunk
            batch_samples = self.step_core.split(batch_samples).tensors
            if num_items_in_batch is not None:
                num_items_in_batch = self.step_core.global_tokens(batch_samples).loss
        if self.global_aux_loss is not None and len(batch_samples) > 1:
            # Several forwards: the global counts must be known before the first one's backward.
            forwards = batch_samples if self.sequence_parallel else [trainer_prepare_inputs(self, batch)
                                                                     for batch in batch_samples]
            self._step_router_stats = self.step_core.router_prepass(self.model, forwards)
        return batch_samples, num_items_in_batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The step's forward (replay, the global aux-loss share) around the trainer class's own compute_loss.
        def forward(batch: dict):
            result = super(StrategyTrainerMixin, self).compute_loss(model, batch, return_outputs=return_outputs,
                                                                     num_items_in_batch=num_items_in_batch)
            return result if return_outputs else (result, None)

        share = forward_share(model, inputs, forward=forward, replay_of=self.replay_of_inputs,
                              balancing=self.global_aux_loss,  # (the step core's)
                              router=self._step_router_stats if self.global_aux_loss is not None else None)
        loss = share.loss
        if share.aux is not None:  # the trainer scales the model's loss itself; the aux share is scaled here
            loss = share.with_aux(aux_scale=share_scale(self, num_items_in_batch))
            if self.aux_loss_window is not None:
                self.aux_loss_window.add(share.aux, accumulation_steps=self.current_gradient_accumulation_steps)
        return (loss, share.outputs) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        self.step_core.count_tokens_of(inputs)  # padding stays out of the expert load
        return super().training_step(model, inputs, num_items_in_batch, *args, **kwargs)

    def replay_of_inputs(self, inputs: dict):
        """``(inputs without their routing record, the context replaying it)``; a trainer whose batches hold no
        ``input_ids`` (GRPO's prompts and completions) says what the record aligns with."""
        return self.strategy.replay_of_batch(inputs)

    def prediction_step(self, *args, **kwargs):
        if self.sequence_parallel:
            raise ParallelConfigError(f"sequence_parallel_size={self.strategy.dims.sp_size}: evaluation is not split "
                                      "along the sequence yet; evaluate with sequence_parallel_size=1")
        return super().prediction_step(*args, **kwargs)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:  # a training log line, written on every rank: the counts are summed over ranks
            fields, _ = self.step_metrics.take()  # the step's tokens, throughput and expert load
            logs = {**logs, **fields}
            agreement = self.strategy.take_routing_agreement()  # routing replay's telemetry, per MoE layer
            if agreement is not None:  # (scalars: HF's loggers take numbers) the layer furthest from the record
                logs["routing_agreement_min"] = round(min(agreement), 4)
                logs["routing_agreement_mean"] = round(sum(agreement) / len(agreement), 4)
        super().log(logs, *args, **kwargs)

    def _move_model_to_device(self, model, device) -> None:
        pass  # every rank's shards are on its device since wrap_model

    # -- gradient norm: expert gradients live on another mesh than the rest
    def _clip_grad_norm(self, model):
        return self.clip_grad_norm(model)

    def clip_grad_norm(self, model) -> torch.Tensor:
        """Clip to ``max_grad_norm`` over every mesh; the norm before clipping."""
        return self.step_core.clip(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.step_core.clip(model, float("inf"))
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # -- saving: every rank writes its own rows; no gather of the model
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # The model's kind of save, as an asynchronous checkpoint declares it (the adapter gathered: synchronous).
        items = declare(model_kind(self.model), sources=self.model_save_sources(adapter_from_trainable_files=False))
        save_pretrained(self.model, output_dir, ep_plan=self.strategy.ep_plan,
                        max_file_bytes=file_size_bytes(self.checkpoint_shard_size),
                        chunk_bytes=self.strategy.init_bucket_bytes, items=items)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_checkpoint(self, model, trial) -> None:
        if self.async_checkpoints is None or trial is not None:  # (hyper-parameter search trials: synchronous)
            return parent_save_checkpoint(self, StrategyTrainerMixin, model, trial)
        self.async_checkpoints.save_checkpoint()

    # What save_model writes with (and so an asynchronous checkpoint's model files).
    checkpoint_shard_size = SAVE_PRETRAINED_SHARD_SIZE

    def model_save_sources(self, *, adapter_from_trainable_files: bool) -> SaveSources:
        """What this trainer brings to a save of its model (:func:`~twinkle_strategy.checkpoint.training.declare`
        lists the items), in :meth:`save_model` and an asynchronous checkpoint (:mod:`.async_save`) alike: the
        tokenizer, and ``training_args.bin``. ``adapter_from_trainable_files``: the save writes ``trainer_state/``
        too, from which rank 0 reads the adapter back at the commit (nothing gathered while training waits)."""
        tokenizer = self.processing_class if hasattr(self.processing_class, "save_pretrained") else None
        args = self.args
        training_args = FrontEndFiles("training_args.bin", every_rank=True, here=args.should_save,
                                      write_files=lambda directory: torch.save(args, os.path.join(directory,
                                                                                                  "training_args.bin")))
        return SaveSources(tokenizer=tokenizer, front_end_files=training_args,
                           adapter_from_trainable_files=adapter_from_trainable_files)

    def checkpoint_started(self, path: str) -> None:
        """Asynchronous saves: called on every rank at the save step of ``path``, before its items are declared;
        nothing here (swift's trainer notes its last checkpoint)."""

    def checkpoint_committed(self, path: str) -> None:
        """Asynchronous saves: called on process zero once ``path`` is durable under its final name (and rotation
        is done), from the commit's thread; nothing here (swift's trainer points its ``last-checkpoint`` link)."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # The trainer state's kind of save, of which the HF Trainer writes its RNG state and trainer_state.json itself.
        sources = SaveSources(optimizer=self.optimizer, scheduler=self.lr_scheduler)
        items = declare(SaveKind.TRAINER_STATE, sources=sources)
        save_items(items, output_dir, model=self.model, ep_plan=self.strategy.ep_plan,
                   subject=f"saving the trainer state into {output_dir}")

    # -- resuming: what a resumed step restores (twinkle_strategy.step.resume), at HF's two seams
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not restore_weights(resume_from_checkpoint, model=model or self.model, strategy=self.strategy):
            raise ResumeError(f"{resume_from_checkpoint} has no trainer_state/: it was not saved through "
                              "NativeFSDPStrategy (or with save_only_model); start a new run from its weights instead")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            restore_trainer_state(checkpoint, model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                                  scheduler=self.lr_scheduler)


def prepare_for_trainer(strategy: NativeFSDPStrategy, model: nn.Module) -> nn.Module:
    """``model`` (in place) as a ``transformers.Trainer`` trains it through ``strategy``: EP and FSDP2 applied
    (unless already), transformers' activation checkpointing replaying the EP dispatch, accelerate told it is
    prepared. Also the swift plugin's, after swift's tuner."""
    if not isinstance(model, FSDPModule):
        strategy.wrap_model(model)
    # transformers' gradient checkpointing must replay the EP dispatch in its recomputation (no second
    # all-to-all, no re-routing), as twinkle-sft's own checkpointing does.
    replay_in_transformers_checkpointing(model)
    mark_accelerate_prepared(model)  # accelerate must neither wrap it in DDP nor shard it again
    return model
