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
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.checkpoint import (
    is_peft_model,
    latest_checkpoint,
    load_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from twinkle_strategy.checkpoint.shared_directory import check_shared_directory
from twinkle_strategy.errors import TrainingAbortedError
from twinkle_strategy.init.liveness import StatusBoard
from twinkle_strategy.runtime import peak_rss_bytes

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

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}; use 'cosine', 'linear' or 'constant'")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


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
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def _format_seconds(s: float) -> str:
    return str(datetime.timedelta(seconds=int(s)))


class Trainer:
    def __init__(self, model, strategy, args: TrainingArguments, train_dataset, data_collator,
                 processing_class=None, run_dir: str | None = None):
        self.model = model
        self.strategy = strategy
        self.args = args
        self.train_dataset = train_dataset
        self.data_collator = data_collator
        self.processing_class = processing_class
        self.run_dir = run_dir
        self.log_history: list[dict] = []

    # ------------------------------------------------------------------ set-up
    def _setup(self):
        strategy, args = self.strategy, self.args
        strategy.setup()
        # Before anything expensive: a save hours from now needs every rank to see the same output_dir.
        check_shared_directory(args.output_dir, what="output_dir")
        if not isinstance(self.model, FSDPModule):
            self.model, _ = strategy.wrap_model(self.model)
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
        if args.resume_from_checkpoint:
            path = args.resume_from_checkpoint
            if not os.path.basename(os.path.normpath(path)).startswith("checkpoint-"):
                path = latest_checkpoint(path) or path
            state = load_checkpoint(path, self.model, self.strategy, optimizer=self.optimizer, scheduler=self.scheduler,
                                    expect={"global_batch": self._global_batch_size(),
                                            "peft": is_peft_model(self.model)})
            self.start_step = state["global_step"]
            self.log_history = state.get("log_history", [])
            if strategy.is_main_process:
                logger.info("resumed from %s at step %d", path, self.start_step)

    def _global_batch_size(self) -> int:
        """Samples per optimizer step; with the seed it decides which samples each step sees."""
        return self.global_batch * self.args.gradient_accumulation_steps

    def _layout(self) -> dict:
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
    def training_step(self, step: int) -> tuple[float, float]:
        """One optimizer step; returns (mean loss per response token over the global batch, grad norm)."""
        device = self.strategy.device
        batches = self._micro_batches(step)
        local_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        global_tokens = _all_reduce_sum(torch.tensor(float(local_tokens), device=device))
        loss_sum = torch.zeros((), device=device)
        self.model.train()
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            # Sum of this rank's token losses / all tokens of the step; FSDP averages gradients over
            # ranks, so scaling by the world size makes the result the global per-token mean.
            loss = self.model(**batch, num_items_in_batch=global_tokens).loss
            (loss * self.world_size).backward()
            loss_sum += loss.detach()
        norm = self.strategy.clip_grad_norm_(self.model, self.args.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(_all_reduce_sum(loss_sum)), float(norm)

    def train(self) -> list[dict]:
        self._setup()
        args, strategy = self.args, self.strategy
        main = strategy.is_main_process
        progress = None
        if main:
            from tqdm.auto import tqdm

            progress = tqdm(total=self.max_steps, initial=self.start_step, desc="Train", dynamic_ncols=True)
        start_time = time.time()
        window: list[float] = []
        last = None
        self._board = StatusBoard("train")
        for step in range(self.start_step, self.max_steps):
            loss, norm = self._guarded(f"step{step + 1}", self.training_step, step)
            global_step = step + 1
            window.append(loss)
            if progress is not None:
                progress.update(1)
            if global_step % args.logging_steps == 0 or global_step == self.max_steps or global_step == 1:
                last = self._log(global_step, sum(window) / len(window), norm, start_time)
                window = []
            if args.save_steps and global_step % args.save_steps == 0 and global_step != self.max_steps:
                self._guarded(f"save{global_step}", self.save, global_step)
        if progress is not None:
            progress.close()
        final = self._guarded(f"save{self.max_steps}", self.save, self.max_steps) \
            if self.max_steps > self.start_step else None
        if main:
            self._plot()
            logger.info("training finished: %s, last checkpoint %s", last, final)
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

    def _log(self, global_step: int, loss: float, norm: float, start_time: float) -> dict:
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
                 "peft": is_peft_model(self.model), **self._layout()}
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
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("matplotlib is not installed: no loss plot")
            return
        steps = [int(e["global_step/max_steps"].split("/")[0]) for e in self.log_history]
        losses = [e["loss"] for e in self.log_history]
        os.makedirs(os.path.join(self.run_dir, "images"), exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(steps, losses, marker="o")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title("train loss")
        ax.grid(alpha=0.3)
        out = os.path.join(self.run_dir, "images", "train_loss.png")
        fig.savefig(out, dpi=100, bbox_inches="tight")
        plt.close(fig)
        print(f"loss curve: {out}", flush=True)
