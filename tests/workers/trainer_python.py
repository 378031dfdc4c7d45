"""The demo run through the Python API (Trainer(strategy=...)), then a short full-parameter run.

Writes per rank: the LoRA run's losses, the distributed model's logits on a probe
batch after training, and the same for the full-parameter run.
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

PROBE = 3


def probe_logits(model, strategy, dataset, collator):
    """Logits of the distributed model for the first PROBE examples (every rank runs the same batch)."""
    batch = collator([dataset[i] for i in range(PROBE)])
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    args = p.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = SFTDataset.from_jsonl(args.dataset, tokenizer, max_length=64)
    collator = DataCollatorForSFT(tokenizer.pad_token_id)

    # Same settings as yaml/demo.yaml.
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, device_type="cpu")
    model = strategy.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(42)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    train_args = TrainingArguments(output_dir=os.path.join(args.output_dir, "lora"), max_steps=args.max_steps,
                                   per_device_train_batch_size=4, learning_rate=5e-3, lr_scheduler_type="cosine",
                                   warmup_ratio=0.05, max_grad_norm=1.0, logging_steps=1, seed=42)
    trainer = Trainer(model=model, strategy=strategy, args=train_args, train_dataset=dataset,
                      data_collator=collator, processing_class=tokenizer)
    history = trainer.train()
    lora_logits = probe_logits(trainer.model, strategy, dataset, collator)

    full_strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", device_type="cpu")
    full_model = full_strategy.from_pretrained(args.model, dtype=torch.float32)
    full_args = TrainingArguments(output_dir=os.path.join(args.output_dir, "full"), max_steps=2,
                                  per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1, seed=1)
    full_trainer = Trainer(model=full_model, strategy=full_strategy, args=full_args, train_dataset=dataset,
                           data_collator=collator, processing_class=tokenizer)
    full_trainer.train()
    full_logits = probe_logits(full_trainer.model, full_strategy, dataset, collator)
    return {"losses": [e["loss"] for e in history], "lora_run_dir": trainer.run_dir, "lora_logits": lora_logits,
            "full_run_dir": full_trainer.run_dir, "full_logits": full_logits}


if __name__ == "__main__":
    worker_common.run(main)
