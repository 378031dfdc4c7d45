"""A small SFT trainer around NativeFSDPStrategy, with names close to transformers' Trainer.

    trainer = Trainer(model=model, strategy=strategy, args=TrainingArguments(output_dir="output"),
                      train_dataset=dataset, data_collator=DataCollatorForSFT(tokenizer.pad_token_id),
                      processing_class=tokenizer)
    trainer.train()

Loss normalisation: every optimizer step averages the loss over all response
tokens of the global batch (all ranks, all accumulation micro-batches), so the
result does not depend on how the batch is split across ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import re
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint import (
    is_peft_model,
    latest_checkpoint,
    load_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from twinkle_strategy.checkpoint.shared_directory import check_shared_directory
from twinkle_strategy.errors import ModelStructureError, TrainingAbortedError
from twinkle_strategy.fsdp import find_decoder_layers
from twinkle_strategy.init.liveness import StatusBoard
from twinkle_strategy.messages import broadcast_object
from twinkle_strategy.moe.balance import BalancingLoss, correction_biases, update_correction_bias
from twinkle_strategy.moe.discovery import find_moe_blocks
from twinkle_strategy.moe.load import ExpertLoad
from twinkle_strategy.moe.recompute import apply_activation_checkpointing
from twinkle_strategy.runtime import peak_rss_bytes
from twinkle_strategy.strategy import NativeFSDPStrategy
from twinkle_strategy.train.metrics import StepWindow
from twinkle_strategy.train.plots import plot_expert_load, plot_loss
from twinkle_strategy.train.preemption import PreemptionFlag, newest_run_dir, restart_count
from twinkle_strategy.train.throughput import FlopsModel, device_peak_tflops

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = "output"
    add_version: bool = True  # write into output_dir/v{N}-{YYYYMMDD-HHMMSS}, like swift
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 42
    logging_steps: int = 5
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    save_only_model: bool = False  # skip optimizer state (smaller, but not resumable exactly)
    max_shard_size: str = "5GB"  # largest safetensors file of a saved model, as save_pretrained's
    resume_from_checkpoint: str | None = None  # a checkpoint-* directory, or a run directory (latest is used)
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward (EP dispatch replayed)
    # The model's own load-balancing loss, its token fractions counted over the global batch; 0 = off.
    router_aux_loss_coef: float = 0.0
    # Aux-loss-free balancing of routers with e_score_correction_bias (DeepSeek-V3): bias step size; 0 = off.
    load_balance_coeff: float = 0.0
    peak_tflops: float = 0.0  # the device's peak for mfu; 0: known devices (H100, H200, Ascend 910B) only

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}; use 'cosine', 'linear' or 'constant'")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("router_aux_loss_coef", "load_balance_coeff", "peak_tflops"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")


def make_run_dir(output_dir: str, add_version: bool) -> str:
    """``output_dir/v{N}-{timestamp}`` with N one more than the highest existing version."""
    if not add_version:
        return output_dir
    versions = [int(m.group(1)) for name in (os.listdir(output_dir) if os.path.isdir(output_dir) else [])
                if (m := re.match(r"v(\d+)-", name))]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(output_dir, f"v{max(versions, default=-1) + 1}-{stamp}")


def _broadcast(obj):
    if not dist.is_initialized():
        return obj
    return broadcast_object(obj, src=0)  # byte tensors on the backend's device: HCCL has no object collectives


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def _expert_load_or_none(model: nn.Module, *, ep_size: int) -> ExpertLoad | None:
    """Expert-load counting for an MoE model whose experts call we know; None otherwise (dense models, and
    families EP refuses, which still train with ep_size=1 but log no moe_load_imbalance)."""
    try:
        return ExpertLoad(model, ep_size=ep_size) if find_moe_blocks(model) else None
    except ModelStructureError as exc:
        logger.warning("no expert-load statistics: %s", exc)
        return None


def _rewrite_log(path: str, entries: list[dict]) -> None:
    """logging.jsonl holding exactly ``entries`` (written aside, then renamed over the old one)."""
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    os.replace(path + ".tmp", path)


def _format_seconds(s: float) -> str:
    return str(datetime.timedelta(seconds=int(s)))


class Trainer:
    def __init__(self, model: nn.Module, strategy: NativeFSDPStrategy, args: TrainingArguments, train_dataset,
                 data_collator, processing_class=None, run_dir: str | None = None):
        self.model = model
        self.strategy = strategy
        self.args = args
        self.train_dataset = train_dataset
        self.data_collator = data_collator
        self.processing_class = processing_class
        self.run_dir = run_dir
        self.log_history: list[dict] = []
        self._preemption: PreemptionFlag | None = None

    # ------------------------------------------------------------------ set-up
    def _setup(self):
        strategy, args = self.strategy, self.args
        strategy.setup()
        # Before anything expensive: a save hours from now needs every rank to see the same output_dir.
        check_shared_directory(args.output_dir, what="output_dir")
        wrapped = isinstance(self.model, FSDPModule)
        self._prepare_moe_training(ep_size=strategy.ep_size if wrapped else 1)
        if not wrapped:
            self.model, _ = strategy.wrap_model(self.model)
        self.flops = FlopsModel.of(self.model, ep_size=strategy.ep_size)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters")
        self.optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate, weight_decay=args.weight_decay,
                                           betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        self.world_size = strategy.world_size
        self.global_batch = args.per_device_train_batch_size * self.world_size
        per_step = self.global_batch * args.gradient_accumulation_steps
        self.steps_per_epoch = len(self.train_dataset) // per_step
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(self.train_dataset)} examples, fewer than one optimizer step needs "
                f"({args.per_device_train_batch_size} per device x {self.world_size} ranks x "
                f"{args.gradient_accumulation_steps} accumulation steps = {per_step}); lower the batch size"
            )
        self.max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs *
                                                                              self.steps_per_epoch)
        warmup = args.warmup_steps or math.ceil(args.warmup_ratio * self.max_steps)
        from transformers import get_scheduler

        self.scheduler = get_scheduler(args.lr_scheduler_type, self.optimizer, num_warmup_steps=warmup,
                                       num_training_steps=self.max_steps)
        # torchrun counts restarts per node, and only on the node whose workers failed: ask every rank.
        restarted = bool(_all_reduce_sum(torch.tensor(float(restart_count() > 0), device=strategy.device)) > 0)
        if restarted and self.run_dir is None and args.add_version:
            self.run_dir = newest_run_dir(args.output_dir)  # a restarted worker continues its run, not a new one
        # Rank 0's choice for everyone: with several real nodes, each node's launcher may have named its own.
        self.run_dir = _broadcast((self.run_dir or make_run_dir(args.output_dir, args.add_version))
                                  if strategy.is_main_process else None)
        if strategy.is_main_process:
            os.makedirs(self.run_dir, exist_ok=True)
            with open(os.path.join(self.run_dir, "args.json"), "w") as f:
                json.dump({"training_args": dataclasses.asdict(args), "world_size": self.world_size,
                           "ep_size": strategy.ep_size, "memory_efficient_init": strategy.memory_efficient_init},
                          f, indent=2)
        self.start_step = 0
        path = args.resume_from_checkpoint
        if not path and restarted:
            # torchrun restarted this worker (launch.max_restarts): continue from the newest complete checkpoint.
            path = _broadcast(latest_checkpoint(self.run_dir) if strategy.is_main_process else None)
            if path is None and strategy.is_main_process:
                logger.warning("restarted: no complete checkpoint in %s yet, training from the start", self.run_dir)
        if path:
            self._resume(path, same_run=not args.resume_from_checkpoint)

    def _resume(self, path: str, *, same_run: bool) -> None:
        if not os.path.basename(os.path.normpath(path)).startswith("checkpoint-"):
            path = latest_checkpoint(path) or path
        state = load_checkpoint(path, self.model, self.strategy, optimizer=self.optimizer, scheduler=self.scheduler,
                                expect={"global_batch": self._global_batch_size(), "peft": is_peft_model(self.model)})
        self.start_step = state["global_step"]
        self.log_history = state.get("log_history", [])
        if self.strategy.is_main_process:
            if same_run:  # drop what the interrupted attempt logged after its checkpoint: those steps run again
                _rewrite_log(os.path.join(self.run_dir, "logging.jsonl"), self.log_history)
            logger.info("resumed from %s at step %d", path, self.start_step)

    def _prepare_moe_training(self, *, ep_size: int) -> None:
        """Expert-load counting, the global-batch balancing loss, aux-loss-free biases, activation checkpointing."""
        args, model = self.args, self.model
        self.expert_load = _expert_load_or_none(model, ep_size=ep_size)
        self.balancing = BalancingLoss.of(model) if args.router_aux_loss_coef > 0 else None
        if self.balancing is not None:
            self.balancing.silence_model_term()
        self._aux_checked = False
        self.correction_biases = correction_biases(model) if args.load_balance_coeff > 0 else []
        if args.load_balance_coeff > 0 and not self.correction_biases:
            raise ValueError("load_balance_coeff > 0 needs routers with an e_score_correction_bias (DeepSeek-V3 "
                             f"style); {type(model).__name__} has none: use router_aux_loss_coef instead")
        if args.gradient_checkpointing:
            apply_activation_checkpointing(find_decoder_layers(model))

    def _global_batch_size(self) -> int:
        """Samples per optimizer step; with the seed it decides which samples each step sees."""
        return self.global_batch * self.args.gradient_accumulation_steps

    def _parallel_sizes(self) -> dict:
        return {"world_size": self.world_size, "ep_size": self.strategy.ep_size,
                "nodes": self.strategy.topology.num_nodes, "global_batch": self._global_batch_size()}

    def _micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches of optimizer step ``step``: a seeded permutation per epoch."""
        args, rank = self.args, self.strategy.rank
        epoch, index = divmod(step, self.steps_per_epoch)
        if getattr(self, "_order_epoch", None) != epoch:  # one permutation per epoch, not per step
            generator = torch.Generator().manual_seed(args.seed + epoch)
            self._order = torch.randperm(len(self.train_dataset), generator=generator).tolist()
            self._order_epoch = epoch
        order = self._order
        batches = []
        for micro in range(args.gradient_accumulation_steps):
            base = (index * args.gradient_accumulation_steps + micro) * self.global_batch
            begin = base + rank * args.per_device_train_batch_size
            ids = order[begin:begin + args.per_device_train_batch_size]
            batches.append(self.data_collator([self.train_dataset[i] for i in ids]))
        return batches

    # ---------------------------------------------------------------- training
    def training_step(self, step: int) -> dict:
        """One optimizer step: the global batch's mean loss per response token, grad norm, and statistics."""
        result = self.compute_gradients(step)
        result["grad_norm"] = float(self.strategy.clip_grad_norm_(self.model, self.args.max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        result["expert_counts"] = self.expert_load.take_global() if self.expert_load is not None else None
        if self.correction_biases:
            update_correction_bias(self.correction_biases, result["expert_counts"], self.args.load_balance_coeff)
        return result

    def compute_gradients(self, step: int) -> dict:
        """Forward and backward of every micro-batch of step ``step``; global loss, aux loss and token sums."""
        device = self.strategy.device
        batches = self._micro_batches(step)
        sizes = torch.tensor([sum(float((b["labels"][:, 1:] != -100).sum()) for b in batches),
                              sum(float(b["attention_mask"].sum()) for b in batches)], device=device)
        global_tokens, input_tokens = _all_reduce_sum(sizes)
        self.model.train()
        # Several micro-batches: their global router counts must be known before the first backward.
        router = self._router_prepass(batches) if self.balancing is not None and len(batches) > 1 else None
        sums = torch.zeros(3, device=device)  # loss, aux loss, ranks asked to stop (SIGTERM)
        for batch in batches:
            loss, aux, router = self._forward_backward(batch, global_tokens, router)
            sums[:2] += torch.stack([loss, aux])
        sums[2] = float(self._preemption is not None and self._preemption.requested)
        loss, aux, preempted = _all_reduce_sum(sums).tolist()
        seq_len = sum(b["input_ids"].shape[1] for b in batches) / len(batches)
        return {"loss": loss, "aux_loss": aux, "tokens": float(input_tokens), "seq_len": seq_len,
                "preempted": preempted > 0}

    def _forward_backward(self, batch: dict, global_tokens: torch.Tensor, router):
        """One micro-batch; returns (its loss share, its aux-loss share, the global router statistics)."""
        batch = {k: v.to(self.strategy.device) for k, v in batch.items()}
        if self.expert_load is not None:
            self.expert_load.token_mask = batch.get("attention_mask")
        extra = {"output_router_logits": True} if self.balancing is not None else {}
        out = self.model(**batch, num_items_in_batch=global_tokens, **extra)
        # Sum of this rank's token losses / all tokens of the step; FSDP averages gradients over
        # ranks, so scaling by the world size makes the result the global per-token mean.
        loss, aux = out.loss, torch.zeros((), device=out.loss.device)
        if self.balancing is not None:
            local = self.balancing.statistics(out.router_logits, batch.get("attention_mask"))
            if not self._aux_checked:
                self.balancing.check_matches_model(local, out.aux_loss)
                self._aux_checked = True
            router = router if router is not None else local.reduced()
            aux = self.balancing.loss_part(local, router)
        ((loss + self.args.router_aux_loss_coef * aux) * self.world_size).backward()
        return loss.detach(), aux.detach(), router

    @torch.no_grad()
    def _router_prepass(self, batches: list[dict]):
        """Router statistics of every micro-batch of the step, summed over ranks: one forward without
        gradients first, so the first micro-batch's backward already sees the whole global batch."""
        if self.expert_load is not None:
            self.expert_load.active = False  # the training forwards count the load
        total = None
        try:
            for batch in batches:
                mask = batch["attention_mask"].to(self.strategy.device)
                out = self.model(input_ids=batch["input_ids"].to(self.strategy.device), attention_mask=mask,
                                 output_router_logits=True)
                stats = self.balancing.statistics(out.router_logits, mask)
                total = stats if total is None else total + stats
        finally:
            if self.expert_load is not None:
                self.expert_load.active = True
        return total.reduced()

    def train(self) -> list[dict]:
        self._setup()
        args, strategy = self.args, self.strategy
        main = strategy.is_main_process
        progress = None
        if main:
            from tqdm.auto import tqdm

            progress = tqdm(total=self.max_steps, initial=self.start_step, desc="Train", dynamic_ncols=True)
        start_time = time.time()
        peak = args.peak_tflops or device_peak_tflops(strategy.device)
        window = StepWindow(self.flops, world_size=self.world_size, peak_tflops=peak, with_aux=self.balancing is not None)
        last, final = None, None
        self.load_history: list[tuple[int, list]] = []
        self._board = StatusBoard("train")
        self._preemption = PreemptionFlag()
        try:
            for step in range(self.start_step, self.max_steps):
                result = self._guarded(f"step{step + 1}", self.training_step, step)
                global_step = step + 1
                window.add(result)
                if progress is not None:
                    progress.update(1)
                if global_step % args.logging_steps == 0 or global_step == self.max_steps or global_step == 1 \
                        or result["preempted"]:
                    last = self._log(global_step, window, start_time)
                if result["preempted"]:  # every rank saw the same flag: save this step together, then stop
                    final = self._guarded(f"save{global_step}", self.save, global_step)
                    break
                if args.save_steps and global_step % args.save_steps == 0 and global_step != self.max_steps:
                    self._guarded(f"save{global_step}", self.save, global_step)
            else:
                final = self._guarded(f"save{self.max_steps}", self.save, self.max_steps) \
                    if self.max_steps > self.start_step else None
        finally:
            self._preemption.restore()
        if progress is not None:
            progress.close()
        if main:
            self._plot()
            logger.info("training %s: %s, last checkpoint %s",
                        "stopped by SIGTERM" if self._preemption.requested else "finished", last, final)
            print(f"run directory: {self.run_dir}\nlast checkpoint: {final}", flush=True)
        return self.log_history

    def _guarded(self, phase: str, fn, *args):
        """Run a collective phase; if a peer dies or hangs, raise an error naming the silent ranks."""
        try:
            result = fn(*args)
        except RuntimeError as exc:
            self._board.failed(f"{type(exc).__name__} in {phase}")
            silent = self._board.silent_ranks(phase)
            who = (f"rank(s) {silent} did not report back (one of them died or hung; see their logs)" if silent
                   else "a peer stopped responding")
            raise TrainingAbortedError(f"{phase} failed on rank {self.strategy.rank}: {who}. "
                                       f"Underlying error: {exc}") from exc
        self._board.finished(phase)
        return result

    def _log(self, global_step: int, window: StepWindow, start_time: float) -> dict:
        fields, counts = window.take()
        if counts is not None:
            self.load_history.append((global_step, counts.tolist()))
        loss, norm = fields["loss"], fields["grad_norm"]
        elapsed = time.time() - start_time
        done = global_step - self.start_step
        speed = elapsed / max(done, 1)
        if self.strategy.device.type == "cuda":
            memory = torch.cuda.max_memory_allocated() / 2**30
        else:
            memory = peak_rss_bytes() / 2**30
        entry = {
            "loss": round(loss, 6),
            "grad_norm": round(norm, 6),
            "learning_rate": self.scheduler.get_last_lr()[0],
            "epoch": round(global_step / self.steps_per_epoch, 4),
            "global_step/max_steps": f"{global_step}/{self.max_steps}",
            "percentage": f"{100 * global_step / self.max_steps:.2f}%",
            "elapsed_time": _format_seconds(elapsed),
            "remaining_time": _format_seconds(speed * (self.max_steps - global_step)),
            "memory(GiB)": round(memory, 3),
            "train_speed(s/it)": round(speed, 6),
            **fields["extra"],
        }
        self.log_history.append(entry)
        if self.strategy.is_main_process:
            print(entry, flush=True)
            with open(os.path.join(self.run_dir, "logging.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")
        return entry

    def save(self, global_step: int) -> str:
        from transformers.utils.hub import convert_file_size_to_int

        path = os.path.join(self.run_dir, f"checkpoint-{global_step}")
        state = {"global_step": global_step, "max_steps": self.max_steps, "log_history": self.log_history,
                 "peft": is_peft_model(self.model), **self._parallel_sizes()}
        self.save_report = save_checkpoint(path, self.model, self.strategy, optimizer=self.optimizer,
                                           scheduler=self.scheduler, trainer_state=state, tokenizer=self.processing_class,
                                           save_optimizer=not self.args.save_only_model,
                                           max_file_bytes=convert_file_size_to_int(self.args.max_shard_size),
                                           chunk_bytes=self.strategy.init_bucket_bytes)
        if self.strategy.is_main_process:
            rotate_checkpoints(self.run_dir, self.args.save_total_limit)
            logger.info("saved %s", path)
        return path

    def _plot(self) -> None:
        steps = [int(e["global_step/max_steps"].split("/")[0]) for e in self.log_history]
        out = plot_loss(self.run_dir, steps, [e["loss"] for e in self.log_history])
        if out:
            print(f"loss curve: {out}", flush=True)
        out = plot_expert_load(self.run_dir, [s for s, _ in self.load_history], [c for _, c in self.load_history])
        if out:
            print(f"expert load: {out}", flush=True)
