"""NativeFSDPStrategy in a plain ``python script.py``: no torchrun, no RANK / WORLD_SIZE / MASTER_ADDR.

Records the error of an ep_size that needs more processes, then loads the model with and without
memory_efficient_init and compares it with plain ``from_pretrained`` (weights bit for bit, logits), and trains
two steps with the Trainer.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402


def ep_error() -> str | None:
    try:
        NativeFSDPStrategy(ep_size=2, mixed_precision="no").setup()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return f"{type(exc).__name__}: {exc}"
    return None


def compare_with_plain_load(path: str, memory_efficient_init: bool) -> dict:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    strategy = NativeFSDPStrategy(mixed_precision="no", memory_efficient_init=memory_efficient_init)
    model, _ = strategy.wrap_model(strategy.from_pretrained(path))
    full = strategy.full_state_dict(model)
    expected = reference.state_dict()
    differing = sorted(k for k in expected if not torch.equal(full[k], expected[k]))
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.no_grad():
        gap = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    return {"differing": differing, "compared": len(expected), "logits_gap": gap}


def train_two_steps(path: str, dataset_path: str, output_dir: str) -> list[float]:
    from transformers import AutoTokenizer

    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
    from twinkle_strategy.train.trainer import Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(path)
    strategy = NativeFSDPStrategy(mixed_precision="no")
    args = TrainingArguments(output_dir=output_dir, add_version=False, max_steps=2, logging_steps=1,
                             per_device_train_batch_size=2)
    trainer = Trainer(model=strategy.from_pretrained(path), strategy=strategy, args=args,
                      train_dataset=SFTDataset.from_jsonl(dataset_path, tokenizer, max_length=48),
                      data_collator=DataCollatorForSFT(tokenizer.pad_token_id))
    return [e["loss"] for e in trainer.train()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    args = p.parse_args()
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ
    return {"ep_error": ep_error(),
            "plain": compare_with_plain_load(args.model, memory_efficient_init=False),
            "memory_efficient_init": compare_with_plain_load(args.model, memory_efficient_init=True),
            "losses": train_two_steps(args.model, args.dataset, args.output_dir)}


if __name__ == "__main__":
    worker_common.run(main)
