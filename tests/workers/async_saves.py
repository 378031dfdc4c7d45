"""Asynchronous saves (train.async_save) in real processes, against synchronous saves of the same runs.

Scenarios:

* ``compare``: the same runs saved synchronously and asynchronously (full fp32; LoRA on a bf16 model),
  each checkpoint compared byte for byte; the asynchronous full run's writer pauses in checkpoint-2
  (tests/workers/save_writer_pause.py) until step 3 has begun, and reports when it wrote each file; the bf16 LoRA run's
  until 0.5 s after the save of step 4 began, which must wait for it; then a run whose background write fails
  with ENOSPC on rank 1.
* ``killed``: an asynchronous run whose writers all pause mid-file in checkpoint-4 (its final save), where
  every rank SIGKILLs itself.
* ``resume``: the killed run resumed from its output directory.
"""

import argparse
import errno
import filecmp
import json
import logging
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from save_writer_pause import pause_save_writer, release_once_every_rank_began_step_3  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.checkpoint import background  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
MAX_STEPS, SAVE_STEPS = 4, 2


def make_trainer(args, output_dir, *, async_save, lora=False, dtype=torch.float32, resume=None, max_steps=MAX_STEPS,
                 keep=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
    from twinkle_strategy.train.trainer import Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = SFTDataset.from_jsonl(args.dataset, tokenizer, max_length=48)
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, timeout_s=60)
    model = strategy.from_pretrained(args.model, dtype=dtype)
    if lora:
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    train_args = TrainingArguments(output_dir=output_dir, add_version=False, max_steps=max_steps,
                                   save_steps=SAVE_STEPS, per_device_train_batch_size=2, logging_steps=1,
                                   learning_rate=1e-3, resume_from_checkpoint=resume, async_save=async_save,
                                   max_shard_size="64KB",  # several files per checkpoint
                                   save_total_limit=keep)
    return Trainer(model=model, strategy=strategy, args=train_args, train_dataset=dataset,
                   data_collator=DataCollatorForSFT(tokenizer.pad_token_id))


def losses(history):
    return {e["global_step/max_steps"].split("/")[0]: e["loss"] for e in history}


def same_files(a, b):
    """Files of checkpoint directory ``b`` that differ from ``a``'s, or exist in only one of them
    (trainer_state.json is compared by its losses: its log holds wall-clock times)."""
    different = []
    for root, _, names in os.walk(a):
        for name in names:
            left = os.path.join(root, name)
            right = os.path.join(b, os.path.relpath(left, a))
            if name == "trainer_state.json":
                with open(left) as f, open(right) as g:
                    if losses(json.load(f)["log_history"]) != losses(json.load(g)["log_history"]):
                        different.append(os.path.relpath(left, a))
            elif not os.path.isfile(right) or not filecmp.cmp(left, right, shallow=False):
                different.append(os.path.relpath(left, a))
    count = sum(len(names) for _, _, names in os.walk(b))
    files = sum(len(names) for _, _, names in os.walk(a))
    return {"different": different, "files": files, "files_in_async": count}


def timed_async_run(args, out, pause_dir):
    """The asynchronous run whose writer pauses in checkpoint-2 until step 3 has begun."""
    from twinkle_strategy.train.trainer import Trainer

    os.makedirs(pause_dir, exist_ok=True)
    original = Trainer.training_step
    step_starts = {}

    def timed_step(self, step):
        step_starts[step + 1] = time.time()
        if step + 1 == 3:
            release_once_every_rank_began_step_3(pause_dir)
        return original(self, step)

    Trainer.training_step = timed_step
    try:
        with pause_save_writer("checkpoint-2", pause_dir):
            trainer = make_trainer(args, out, async_save=True)
            history = trainer.train()
    finally:
        Trainer.training_step = original
    writes = {write.name: {name: vars(times) for name, times in write.file_times.items()}
              for write in trainer.checkpoints.finished_writes}
    return {"losses": losses(history), "step_starts": step_starts, "writes": writes,
            "blocked_s": trainer.save_report.seconds, "background": trainer.save_report.background}


class Records(logging.Handler):
    """The messages logged while it is installed (rank 0 logs the waits)."""

    def __init__(self, logger_name: str):
        super().__init__(logging.INFO)
        self.logger = logging.getLogger(logger_name)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


def waiting_bf16_run(args, out, pause_dir):
    """The asynchronous bf16 LoRA run: checkpoint-2's writer pauses mid-file while steps 3 and 4 train, and is
    released 0.5 s after the save of step 4 began, which must wait for it."""
    from twinkle_strategy.train.trainer import Trainer

    os.makedirs(pause_dir, exist_ok=True)
    original_step, original_save = Trainer.training_step, Trainer.save
    step_starts = {}

    def timed_step(self, step):
        step_starts[step + 1] = time.time()
        return original_step(self, step)

    def late_release(self, global_step):
        if global_step == 4 and RANK == 0:
            threading.Timer(0.5, lambda: open(os.path.join(pause_dir, "release"), "w").close()).start()
        return original_save(self, global_step)

    Trainer.training_step, Trainer.save = timed_step, late_release
    try:
        with Records(background.__name__) as records, pause_save_writer("checkpoint-2", pause_dir):
            trainer = make_trainer(args, out, async_save=True, lora=True, dtype=torch.bfloat16)
            history = trainer.train()
    finally:
        Trainer.training_step, Trainer.save = original_step, original_save
    saves = trainer.checkpoints.async_saves
    return {"losses": losses(history), "step_starts": step_starts,
            "writes": {w.name: {n: vars(t) for n, t in w.file_times.items()} for w in saves.finished_writes},
            "waits": [vars(w) for w in saves.waits], "logged": [m for m in records.messages if "waited" in m]}


def failing_run(args, out):
    """Rank 1's background writer finds the disk full in checkpoint-2."""
    original = background.write_piece
    injected = {}

    def disk_full(fd, piece):
        if RANK == 1 and "checkpoint-2" in piece.path:
            injected.setdefault("at", time.time())
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(fd, piece)

    background.write_piece = disk_full
    try:
        make_trainer(args, out, async_save=True).train()
        return {"error_type": None, **injected}
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return {"error_type": type(exc).__name__, "error": str(exc), "raised_at": time.time(), **injected}
    finally:
        background.write_piece = original


def preempted_run(args, out):
    """Every rank gets SIGTERM as step 3 begins, while checkpoint-2 is still being written in the background."""
    from twinkle_strategy.train.trainer import Trainer

    pause_dir = f"{out}-pause"
    os.makedirs(pause_dir, exist_ok=True)
    original = Trainer.training_step

    def step_with_sigterm(self, step):
        if step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only raises a flag
            if RANK == 0:
                open(os.path.join(pause_dir, "release"), "w").close()
        return original(self, step)

    Trainer.training_step = step_with_sigterm
    try:
        with pause_save_writer("checkpoint-2", pause_dir):
            trainer = make_trainer(args, out, async_save=True)
            history = trainer.train()
    finally:
        Trainer.training_step = original
    return {"losses": losses(history), "finished": [w.name for w in trainer.checkpoints.finished_writes]}


def compare(args):
    out = args.output_dir
    result = {}
    sync = make_trainer(args, f"{out}/sync", async_save=False).train()
    result["sync_losses"] = losses(sync)
    result["full"] = timed_async_run(args, f"{out}/async", f"{out}/pause")
    dist.barrier()
    if RANK == 0:
        result["full"]["files"] = {f"checkpoint-{s}": same_files(f"{out}/sync/checkpoint-{s}",
                                                                 f"{out}/async/checkpoint-{s}")
                                   for s in range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)}
    bf16 = {"losses_False": losses(make_trainer(args, f"{out}/bf16-False", async_save=False, lora=True,
                                                dtype=torch.bfloat16).train())}
    bf16["True"] = waiting_bf16_run(args, f"{out}/bf16-True", f"{out}/bf16-pause")
    dist.barrier()
    if RANK == 0:
        bf16["files"] = {f"checkpoint-{s}": same_files(f"{out}/bf16-False/checkpoint-{s}",
                                                       f"{out}/bf16-True/checkpoint-{s}")
                         for s in range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS)}
    result["bf16"] = bf16
    result["preempted"] = preempted_run(args, f"{out}/preempted")
    dist.barrier()
    result["preempted"]["left"] = sorted(os.listdir(f"{out}/preempted"))
    result["failing"] = failing_run(args, f"{out}/failing")
    dist.barrier()  # rank 0 removed the pending directory before it raised
    result["failing"]["left"] = sorted(os.listdir(f"{out}/failing"))
    return result


def killed(args):
    pause_dir = os.path.join(args.output_dir, "pause")
    os.makedirs(pause_dir, exist_ok=True)

    def kill_once_every_writer_is_mid_file():
        while len([n for n in os.listdir(pause_dir) if n.startswith("paused.rank")]) < 4:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_once_every_writer_is_mid_file, daemon=True).start()
    # save_total_limit=1: checkpoint-2 may go only once checkpoint-4 is durable, which it never becomes here.
    with pause_save_writer("checkpoint-4", pause_dir):
        make_trainer(args, args.output_dir, async_save=True, keep=1).train()
        time.sleep(600)  # not reached: the thread above kills this process while checkpoint-4 is being written


def resume(args):
    trainer = make_trainer(args, args.output_dir, async_save=True, resume=args.output_dir, keep=1)
    history = trainer.train()
    return {"start_step": trainer.start_step, "losses": losses(history)}


SCENARIOS = {f.__name__: f for f in (compare, killed, resume)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    args = p.parse_args()
    return SCENARIOS[args.scenario](args)


if __name__ == "__main__":
    worker_common.run(main)
