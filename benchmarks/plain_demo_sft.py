"""The plain transformers + PEFT script that does what ``twinkle-sft``'s one-process demo does, timed beside it by
``demo_wall.py``: the baseline of "a 3-step demo run in at most 2.5x a plain script's wall time".

    python benchmarks/plain_demo_sft.py --model output/tiny/demo --dataset examples/data/demo_sft.jsonl \\
        --max-steps 3 --output-dir /tmp/plain_demo

What ``twinkle-sft --model tiny://demo --dataset examples/data/demo_sft.jsonl --max_steps 3`` runs, written as a user
writes it without this package: the same checkpoint in bf16, LoRA r=8 (alpha 32) on every linear layer and on the
experts, the dataset's conversations through the tokenizer's chat template with labels on the answers only, the rows
twinkle-sft's sampler picks (a permutation seeded with the seed), one row a step, AdamW (fused) at 1e-4 with a cosine
schedule, gradients clipped to 1.0, then the adapter, the tokenizer and the optimizer and scheduler state saved.
It prints one JSON line: the losses and the tokens of each step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def tokenized(tokenizer, messages: list[dict]) -> dict[str, torch.Tensor]:
    """input_ids and labels of one conversation, labels only on the last (assistant) turn."""
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
    full = tokenizer.apply_chat_template(messages, return_dict=False)
    labels = [-100] * len(prompt) + full[len(prompt):]
    return {"input_ids": torch.tensor([full]), "labels": torch.tensor([labels])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with open(args.dataset) as f:
        rows = [json.loads(line)["messages"] for line in f if line.strip()]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    torch.manual_seed(args.seed)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=0, num_training_steps=args.max_steps)
    losses, tokens = [], []
    for step in range(args.max_steps):
        batch = tokenized(tokenizer, rows[order[step]])
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 6))
        tokens.append(batch["input_ids"].numel())
    checkpoint = os.path.join(args.output_dir, f"checkpoint-{args.max_steps}")
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
               os.path.join(checkpoint, "optimizer.pt"))
    print(json.dumps({"losses": losses, "tokens": tokens, "checkpoint": checkpoint}), flush=True)


if __name__ == "__main__":
    main()
