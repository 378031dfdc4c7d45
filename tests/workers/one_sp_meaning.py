"""A twinkle-sft recipe trained by ``with_strategy(transformers.Trainer)`` instead of twinkle's Trainer.

``worker.py RECIPE_ARGS...``: the recipe (twinkle-sft's own parsing of the same arguments) gives the strategy, the
model with its fresh LoRA adapter, the tokenized dataset and the collator, exactly as twinkle-sft builds them; only
the trainer is transformers'. The dataset is handed over in the order twinkle's step sampler takes it (sequential
sampling), so that the examples of each step are the recipe's whatever the trainer, if the two front-ends give
``sequence_parallel_size`` the same meaning.

Writes per rank the per-step losses, gradient norms and step fields (tokens, throughput) HF logs, and the dataset
indices each collated micro-batch held (in training order).
"""

from __future__ import annotations

import math
import os
import sys

import worker_common

# What every front-end's log line adds of the step (twinkle_strategy.step.metrics), where present.
STEP_FIELDS = ("tokens", "tokens_per_second", "flops_per_token", "tflops_per_device", "mfu", "moe_load_imbalance")


def main():
    from transformers import Trainer, TrainingArguments

    from twinkle_strategy import with_strategy
    from twinkle_strategy.train.cli import parse
    from twinkle_strategy.train.data import StepSampler
    from twinkle_strategy.train.run import build_training

    recipe = parse(sys.argv[1:])
    twinkle_trainer, strategy = build_training(recipe, print_summary=False)  # built, never set up: nothing trained
    train = recipe.train
    dataset, collator = twinkle_trainer.train_dataset, twinkle_trainer.data_collator
    per_step = train.per_device_train_batch_size * strategy.data_parallel_size * train.gradient_accumulation_steps
    sampler = StepSampler(len(dataset), per_step=per_step, seed=train.seed)
    order = [i for step in range(train.max_steps) for i in sampler.rows(step)]
    # An example by its tokens (the demo data repeats some): one index for equal examples.
    index_of = {tuple(dataset[i]["input_ids"]): i for i in sorted(set(order))}
    collated: list[list[int]] = []

    def recording_collator(features):
        collated.append([index_of[tuple(f["input_ids"])] for f in features])
        return collator(features)

    args = TrainingArguments(
        output_dir=os.path.join(os.environ["TWINKLE_TEST_OUT"], "hf"), max_steps=train.max_steps,
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps, learning_rate=train.learning_rate,
        weight_decay=train.weight_decay, adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2,
        adam_epsilon=train.adam_epsilon, optim=train.optim, lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.warmup_steps or math.ceil(train.warmup_ratio * train.max_steps),
        max_grad_norm=train.max_grad_norm, logging_steps=1, save_strategy="no", train_sampling_strategy="sequential",
        remove_unused_columns=False, use_cpu=True, report_to=[], seed=train.seed, dataloader_num_workers=0,
        disable_tqdm=True)
    trainer = with_strategy(Trainer)(model=twinkle_trainer.model, args=args, strategy=strategy,
                                     train_dataset=[dataset[i] for i in order], data_collator=recording_collator)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    steps = train.max_steps * train.gradient_accumulation_steps  # (the dataloader may collate one batch ahead)
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs],
            "step_fields": [{k: h[k] for k in STEP_FIELDS if k in h} for h in logs],
            "micro_batches": collated[:steps], "dp_rank": strategy.data_parallel_rank,
            "step_rows": [[index_of[tuple(dataset[i]["input_ids"])] for i in sampler.rows(step)]
                          for step in range(train.max_steps)],
            # each step's examples' lengths (all real tokens): what its tokens and attention length are counted on
            "step_lengths": [[len(dataset[i]["input_ids"]) for i in sampler.rows(step)]
                             for step in range(train.max_steps)]}


if __name__ == "__main__":
    worker_common.run(main)
