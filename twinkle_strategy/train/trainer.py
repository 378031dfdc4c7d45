"""A small SFT trainer around NativeFSDPStrategy, with names close to transformers' Trainer.

    trainer = Trainer(model=model, strategy=strategy, args=TrainingArguments(output_dir="output"),
                      train_dataset=dataset, data_collator=DataCollatorForSFT(tokenizer.pad_token_id),
                      processing_class=tokenizer)
    trainer.train()

Loss normalisation: every optimizer step averages the loss over all response
tokens of the global batch (all ranks, all accumulation micro-batches), so the
result does not depend on how the batch is split across ranks.

No host sync inside a step: a step's loss, aux loss, grad norm, token and expert
counts stay tensors on the device until the logging window's line reads them
(:class:`~twinkle_strategy.train.metrics.StepWindow`), so the host keeps queuing
work ahead of the device; the one per-step agreement, whether to stop
(SIGTERM), is a host collective (:meth:`PreemptionFlag.agreed`). Nothing else
needs a host value per step: the loop counts steps in Python, and there is no
inf/NaN guard to read (a non-finite loss shows in the log line).
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint import CheckpointManager, CheckpointPolicy, is_peft_model
from twinkle_strategy.checkpoint.directories import check_shared_directory
from twinkle_strategy.compat.transformers_internals import file_size_bytes
from twinkle_strategy.distributed.fatal_errors import one_line, stopped_by_peer
from twinkle_strategy.distributed.liveness import StatusBoard
from twinkle_strategy.errors import TrainingAbortedError
from twinkle_strategy.fsdp import find_decoder_layers
from twinkle_strategy.moe.balance import GlobalBatchAuxLoss, correction_biases, update_correction_bias
from twinkle_strategy.moe.recompute import apply_activation_checkpointing
from twinkle_strategy.quantized.kept import kept_weight_log
from twinkle_strategy.step import StepBatches, StepPolicy, TrainingStep, all_reduce_sum
from twinkle_strategy.step.resume import restore_step
from twinkle_strategy.step.run_files import append_log, log_path, rewrite_log, where_results_are
from twinkle_strategy.strategy import NativeFSDPStrategy
from twinkle_strategy.train.arguments import OptimizerName, TrainingArguments
from twinkle_strategy.train.data import StepSampler
from twinkle_strategy.train.errors import RecipeError
from twinkle_strategy.train.log_lines import lines_above, log_entry, print_line
from twinkle_strategy.train.metrics import StepWindow
from twinkle_strategy.train.packing import DataCollatorForPacking, prepare_for_packed_batches
from twinkle_strategy.train.plots import plot_expert_load, plot_loss
from twinkle_strategy.train.preemption import PreemptionFlag
from twinkle_strategy.train.run_dir import open_run_dir
from twinkle_strategy.train.start_time import StartClock
from twinkle_strategy.train.state import TrainState

__all__ = ["Trainer", "TrainingArguments", "TrainState"]

logger = logging.getLogger(__name__)


class Trainer:
    """``train()`` runs :meth:`setup` (once), then the steps from ``state.start_step`` to ``state.max_steps``.

    ``run_dir``: the run directory a launcher chose (default: a new ``v{N}-{time}`` under ``args.output_dir``).
    ``print_summary``: print the run directory and the last checkpoint at the end (twinkle-sft's launcher turns
    it off in its workers: it prints them itself once every rank has finished).
    """

    def __init__(self, model: nn.Module, strategy: NativeFSDPStrategy, args: TrainingArguments, train_dataset,
                 data_collator, processing_class=None, run_dir: str | None = None, *, print_summary: bool = True,
                 model_path: str | None = None, start_clock: StartClock | None = None):
        self.model = model
        self.strategy = strategy
        self.args = args
        self.train_dataset = train_dataset
        self.data_collator = data_collator
        self.processing_class = processing_class
        self.run_dir = run_dir
        self.print_summary = print_summary
        self.model_path = model_path  # the local directory the base was loaded from (merge_lora's release)
        self.start_clock = start_clock  # twinkle-sft's start, told in one line after the first step
        # Set by setup():
        self.state: TrainState | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.checkpoints: CheckpointManager | None = None
        self.sampler: StepSampler | None = None
        self.step_core: TrainingStep | None = None  # the step every front-end takes (split, tokens, aux, clipping)
        self.balancing: GlobalBatchAuxLoss | None = None
        self.correction_biases: list = []
        self.save_report = None  # of this rank's last save
        self._board: StatusBoard | None = None
        self._preemption: PreemptionFlag | None = None

    @property
    def log_history(self) -> list[dict]:
        return self.state.log_history if self.state is not None else []

    @property
    def start_step(self) -> int:
        return self.state.start_step if self.state is not None else 0

    # ------------------------------------------------------------------ set-up
    def setup(self) -> TrainState:
        """Wrap the model, build the optimizer and scheduler, open the run directory, resume (collective, once)."""
        if self.state is not None:
            return self.state
        strategy, args = self.strategy, self.args
        strategy.setup()
        # Before anything expensive: a save hours from now needs every rank to see the same output_dir.
        check_shared_directory(args.output_dir, what="output_dir")
        self._wrap_model()
        self._make_optimizer()
        self.sampler = self._make_sampler()
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs *
                                                                        self.sampler.steps_per_epoch)
        self._make_scheduler(max_steps)
        run = open_run_dir(args, strategy, self.run_dir)
        self.run_dir = run.path
        self.checkpoints = self._checkpoint_manager(run.path)
        state = TrainState(max_steps=max_steps, steps_per_epoch=self.sampler.steps_per_epoch,
                           global_batch=self.sampler.per_step)
        path = self.checkpoints.resume_path(args.resume_from_checkpoint, restarted=run.restarted)
        if path:
            self._resume(state, path, same_run=not args.resume_from_checkpoint)
        self.state = state
        return state

    def _wrap_model(self) -> None:
        wrapped = isinstance(self.model, FSDPModule)
        if isinstance(self.data_collator, DataCollatorForPacking):  # before training, the same on every rank
            prepare_for_packed_batches(self.model)
        self._prepare_moe_training(ep_size=self.strategy.ep_size if wrapped else 1)
        if not wrapped:
            self.model, _ = self.strategy.wrap_model(self.model)

    def _make_optimizer(self) -> None:
        args = self.args
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise RecipeError("the model has no trainable parameters")
        # Fused by default (HF Trainer's adamw_torch_fused, torchtitan's default): one kernel per device and dtype
        # instead of a chain of foreach ops, the same state either way (args.optim chooses; see OptimizerName).
        self.optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay,
                                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                           **OptimizerName(args.optim).torch_options())

    def _make_scheduler(self, max_steps: int) -> None:
        args = self.args
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup,
                                       num_training_steps=max_steps)

    def _make_sampler(self) -> StepSampler:
        # The ranks of a sequence-parallel group share their examples: a step has one share per data-parallel rank.
        args, world = self.args, self.strategy.data_parallel_size
        per_step = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        sampler = StepSampler(len(self.train_dataset), per_step=per_step, seed=args.seed)
        if sampler.steps_per_epoch == 0:
            raise RecipeError(
                f"the dataset has {len(self.train_dataset)} examples, fewer than one optimizer step needs "
                f"({args.per_device_train_batch_size} per device x {world} data-parallel ranks x "
                f"{args.gradient_accumulation_steps} accumulation steps = {per_step}); lower the batch size"
            )
        return sampler

    def _checkpoint_manager(self, run_dir: str) -> CheckpointManager:
        args = self.args
        policy = CheckpointPolicy(interval=args.save_steps, keep_latest=args.save_total_limit,
                                  save_optimizer=not args.save_only_model,
                                  max_file_bytes=file_size_bytes(args.max_shard_size),
                                  chunk_bytes=self.strategy.init_bucket_bytes, async_save=args.async_save,
                                  pin_memory=self.strategy.device.type != "cpu")
        return CheckpointManager(run_dir, model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                                 scheduler=self.scheduler, tokenizer=self.processing_class, policy=policy)

    def _resume(self, state: TrainState, path: str, *, same_run: bool) -> None:
        saved = restore_step(path, model=self.model, strategy=self.strategy, optimizer=self.optimizer,
                             scheduler=self.scheduler, expect={"global_batch": state.global_batch,
                                                               "peft": is_peft_model(self.model)})
        state.resume(saved)
        if self.strategy.is_main_process:
            if same_run:  # drop what the interrupted attempt logged after its checkpoint: those steps run again
                rewrite_log(self.run_dir, state.log_history)
            logger.info("resumed from %s at step %d", path, state.start_step)

    def _prepare_moe_training(self, *, ep_size: int) -> None:
        """Expert-load counting, the global-batch balancing loss, aux-loss-free biases, activation checkpointing."""
        args, model = self.args, self.model
        self.balancing = (GlobalBatchAuxLoss.replacing_model_term(model, coef=args.router_aux_loss_coef)
                          if args.router_aux_loss_coef > 0 else None)
        self.step_core = TrainingStep(self.strategy, model, balancing=self.balancing, ep_size=ep_size,
                                      policy=StepPolicy(max_grad_norm=args.max_grad_norm, peak_tflops=args.peak_tflops))
        self.correction_biases = correction_biases(model) if args.load_balance_coeff > 0 else []
        if args.load_balance_coeff > 0 and not self.correction_biases:
            raise RecipeError("load_balance_coeff > 0 needs routers with an e_score_correction_bias (DeepSeek-V3 "
                             f"style); {type(model).__name__} has none: use router_aux_loss_coef instead")
        if args.gradient_checkpointing:
            apply_activation_checkpointing(find_decoder_layers(model))

    def _parallel_shape(self) -> dict:
        """What a checkpoint records of the run that saved it (resume checks the global batch)."""
        return {"world_size": self.strategy.world_size, "ep_size": self.strategy.ep_size,
                "nodes": self.strategy.topology.num_nodes, "global_batch": self.state.global_batch}

    def _micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of optimizer step ``step``: its share of each micro-batch of the global batch
        (with sequence parallelism: its group's share, cut to this rank's chunk of the sequence)."""
        return self._step_batches(step).tensors

    def _step_batches(self, step: int) -> StepBatches:
        return self.step_core.split(self._collated(step))

    def _collated(self, step: int) -> list[dict]:
        """This rank's data-parallel share of each micro-batch of step ``step``, as collated (whole rows)."""
        args, rank = self.args, self.strategy.data_parallel_rank
        per_device = args.per_device_train_batch_size
        rows = self.sampler.rows(step)
        batches = []
        for micro in range(args.gradient_accumulation_steps):
            begin = (micro * self.strategy.data_parallel_size + rank) * per_device
            batches.append(self.data_collator([self.train_dataset[i] for i in rows[begin:begin + per_device]]))
        return batches

    # ---------------------------------------------------------------- training
    def training_step(self, step: int) -> dict:
        """One optimizer step: the global batch's mean loss per response token, grad norm, and statistics, as device
        tensors (read by the log line: no host sync here); ``preempted``: whether every rank stops after it."""
        result = self.compute_gradients(step)
        result["grad_norm"] = self.step_core.clip(self.model)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        result["expert_counts"] = self.step_core.take_expert_counts()
        # [layers, (agreeing, replayed)] counts; None unless the model's routing can be replayed
        result["routing_agreement"] = self.strategy.take_routing_agreement_counts()
        if self.correction_biases:
            update_correction_bias(self.correction_biases, result["expert_counts"], self.args.load_balance_coeff)
        # Ranks asked to stop (SIGTERM): agreed on the host, so that no step waits for the device to answer.
        result["preempted"] = self._preemption is not None and self._preemption.agreed(
            timeout_s=self.strategy.timeout_s)
        return result

    def compute_gradients(self, step: int) -> dict:
        """Forward and backward of every micro-batch of step ``step`` (the step core's); global loss, aux loss and
        input-token sums, as device scalars (summed over ranks on the device: the log line reads them)."""
        gradients = self.step_core.accumulate(self.model, self._collated(step), forward=self._forward)
        loss, aux = all_reduce_sum(gradients.shares)
        return {"loss": loss, "aux_loss": aux, "tokens": gradients.tokens.inputs}

    def _forward(self, chunk: dict, global_tokens: torch.Tensor):
        """The model's loss share of one chunk (this rank's token-loss sum / all tokens of the step), its output."""
        out = self.model(**chunk, num_items_in_batch=global_tokens)
        return out.loss, out

    def train(self) -> list[dict]:
        state = self.setup()
        if self.start_clock is not None:
            self.start_clock.ready()
        args, strategy = self.args, self.strategy
        progress = None
        if strategy.is_main_process:
            from tqdm.auto import tqdm

            progress = tqdm(total=state.max_steps, initial=state.start_step, desc="Train", dynamic_ncols=True)
        window = StepWindow(self.step_core.metrics, with_aux=self.balancing is not None)
        self._board = StatusBoard("train")
        self._preemption = PreemptionFlag()
        try:
            with lines_above(progress):
                final = self._run_steps(state, window, progress)
        finally:
            self._preemption.restore()
            if progress is not None:
                progress.close()
        merged = None
        if args.merge_lora and final is not None and state.global_step == state.max_steps \
                and not self._preemption.requested:
            merged = self._guarded("merge_lora", self.save_merged, final)
        if strategy.is_main_process:
            self._plot()
            if merged is not None and not self.print_summary:
                print(f"merged model: {merged}", flush=True)
            if self._preemption.requested:
                logger.info("stopped by SIGTERM after step %d of %d", state.global_step, state.max_steps)
            if self.print_summary:
                print(where_results_are(run_directory=self.run_dir, last_checkpoint=final, merged=merged,
                                        log_file=log_path(self.run_dir)), flush=True)
        return state.log_history

    def _run_steps(self, state: TrainState, window: StepWindow, progress) -> str | None:
        """The steps from ``state.global_step`` on, logging and saving; the path of the last checkpoint saved."""
        args, start_time = self.args, time.time()
        for step in range(state.global_step, state.max_steps):
            result = self._guarded(f"step{step + 1}", self.training_step, step)
            state.global_step = step + 1
            if self.start_clock is not None and (start := self.start_clock.first_step_done()) is not None \
                    and self.strategy.is_main_process:
                print_line(start.line())
            if self.checkpoints.in_flight is not None:  # a background save's failure stops every rank here
                self._guarded(f"step{state.global_step}-background-save", self.checkpoints.poll)
            window.add(result)
            if progress is not None:
                progress.update(1)
            last = state.global_step == state.max_steps
            if state.global_step % args.logging_steps == 0 or last or state.global_step == 1 or result["preempted"]:
                self._log(window, start_time)
            if result["preempted"] or last:  # preempted: every rank saw the same flag, so they save together
                path = self._guarded(f"save{state.global_step}", self.save, state.global_step)
                self._guarded(f"save{state.global_step}-background", self.checkpoints.wait)  # async: exit once durable
                return path
            if self.checkpoints.should_save(state.global_step):
                self._guarded(f"save{state.global_step}", self.save, state.global_step)
        return None  # nothing left to train: resumed at max_steps

    def _guarded(self, phase: str, fn, *args):
        """Run a collective phase; if a peer dies or hangs, raise an error naming the silent ranks. A rank's own
        error is recorded on the board before it leaves: the peers it strands name it as the cause."""
        try:
            result = fn(*args)
        except Exception as exc:
            after_peer = stopped_by_peer(exc, self.strategy.rank)
            self._board.failed(f"{type(exc).__name__} in {phase}" if after_peer else one_line(exc), after_peer=after_peer)
            if not isinstance(exc, RuntimeError):
                raise
            who, _ = self._board.who_stopped(phase)
            raise TrainingAbortedError(f"{phase} failed on rank {self.strategy.rank}: {who}. "
                                       f"Underlying error: {exc}") from exc
        self._board.finished(phase)
        return result

    def _log(self, window: StepWindow, start_time: float) -> dict:
        state = self.state
        fields, counts = window.take()
        if counts is not None:
            state.expert_load_history.append((state.global_step, counts.tolist()))
        entry = log_entry(state, fields, elapsed=time.time() - start_time, device=self.strategy.device,
                          learning_rate=self.scheduler.get_last_lr()[0],
                          kept=kept_weight_log(self.strategy.init_report))  # quantized_base=keep: frozen bytes
        if self.start_clock is not None:
            entry.update(self.start_clock.take_log_fields())  # the start's parts, in the entry after the first step
        state.log(state.global_step, entry)
        if self.strategy.is_main_process:
            print_line(str(entry))
            append_log(self.run_dir, entry)
        return entry

    def save(self, global_step: int) -> str:
        """Save ``checkpoint-{global_step}`` in the run directory (collective); its path."""
        trainer_state = {**self.state.saved_at(global_step), "peft": is_peft_model(self.model),
                         **self._parallel_shape()}
        self.save_report = self.checkpoints.save(global_step, trainer_state)
        return self.checkpoints.path(global_step)

    def save_merged(self, checkpoint: str) -> str:
        """merge_lora: the adapters merged into the base, saved as ``{checkpoint}-merged`` (as swift export names
        it), in train.merged_format. Collective; consumes the model (called after the last step)."""
        directory = f"{checkpoint}-merged"  # (recipe checks refuse merge_lora without LoRA before training)
        self.strategy.save_merged(self.model, directory, merged_format=self.args.merged_format,
                                  release=self.model_path, max_shard_size=self.args.max_shard_size)
        return directory

    def _plot(self) -> None:
        state = self.state
        out = plot_loss(self.run_dir, state.logged_steps, [e["loss"] for e in state.log_history])
        if out:
            print(f"loss curve: {out}", flush=True)
        load = state.expert_load_history
        out = plot_expert_load(self.run_dir, [s for s, _ in load], [c for _, c in load])
        if out:
            print(f"expert load: {out}", flush=True)
