"""Full-parameter training with checkpoints: save in parallel, resume on the same or another layout.

Trains the model with memory_efficient_init and the Trainer. At every save the
checkpoint's SaveReport is recorded and, on rank 0, the model gathered right
after saving (for the test to compare with the files). Records every step's loss.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset  # noqa: E402
from twinkle_strategy.train.trainer import Trainer, TrainingArguments  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--per-device", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    p.add_argument("--max-shard-size", default="5GB")
    return train(p.parse_args())


def train(args) -> dict:
    """Train (and save, and resume) as ``args`` say; also called by tests/workers/smoke.py."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = SFTDataset.from_jsonl(args.dataset, tokenizer, max_length=48)
    strategy = NativeFSDPStrategy(ep_size=args.ep, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=args.bucket_bytes / 2**20, device_type="cpu")
    model = strategy.from_pretrained(args.model, dtype=torch.float32)
    train_args = TrainingArguments(output_dir=args.output_dir, add_version=False, max_steps=args.max_steps,
                                   per_device_train_batch_size=args.per_device, learning_rate=2e-3,
                                   lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1,
                                   save_steps=args.save_steps, seed=7, resume_from_checkpoint=args.resume,
                                   max_shard_size=args.max_shard_size)
    trainer = Trainer(model=model, strategy=strategy, args=train_args, train_dataset=dataset,
                      data_collator=DataCollatorForSFT(tokenizer.pad_token_id), processing_class=tokenizer)
    reports = {}
    save = Trainer.save

    def save_and_record(self, step):
        path = save(self, step)
        reports[step] = vars(self.save_report)
        # The model as it is now, gathered (a test-side oracle, not part of the save).
        gathered = strategy.full_state_dict(self.model, rank0_only=True)
        if strategy.rank == 0:
            torch.save(gathered, os.path.join(args.output_dir, f"gathered-{step}.pt"))
        return path

    Trainer.save = save_and_record
    try:
        history = trainer.train()
    finally:
        Trainer.save = save
    steps = {int(e["global_step/max_steps"].split("/")[0]): e["loss"] for e in history}
    losses = {step: loss for step, loss in steps.items() if step > trainer.start_step}  # this run's own
    return {"losses": losses, "start_step": trainer.start_step, "save_reports": reports,
            "world_size": strategy.world_size, "nodes": strategy.topology.num_nodes}


if __name__ == "__main__":
    worker_common.run(main)
