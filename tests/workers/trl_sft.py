"""TRL's SFTTrainer on a conversational dataset, LoRA on attention and experts passed as ``peft_config``.

``--mode plain``: plain SFTTrainer on one process, the whole global batch per optimizer step.
``--mode strategy``: ``with_strategy(SFTTrainer)`` with NativeFSDPStrategy(ep_size=--ep, memory_efficient_init),
each rank its part of every global batch; ``--resume DIR`` resumes from a checkpoint another layout saved;
``--sp N``: sequence_parallel_size N (the ranks of a group share their examples, each a chunk of every row: the
per-device batch is N times larger, so that the global batch stays the same).
Two runs (one with --resume): ``lora`` with TRL's MoE aux loss off (router_aux_loss_coef=0), saving a checkpoint;
``aux`` with it on (a coefficient large enough that a per-rank aux loss would show), where the plain process
takes the whole global batch in one micro-batch, so that TRL's own aux loss there is the global batch's: the
strategy's ranks, two micro-batches each, must give the same.
``--mode strategy`` then also trains ``defaults_bf16`` and ``defaults_fp32``: TRL's defaults (full parameters,
its MoE aux loss on with the model's coefficient, gradient checkpointing), 3 steps, with
NativeFSDPStrategy(mixed_precision='bf16') on the model loaded in bf16, and in fp32.
Writes per rank and run the per-step losses and gradient norms (with their step numbers), and the aux losses TRL
logs.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

STEPS, SAVE_STEP, MICRO, GLOBAL_BATCH = 4, 2, 1, 8  # GLOBAL_BATCH = MICRO x ranks x accumulation steps
AUX_COEF = 0.5  # SFTConfig.router_aux_loss_coef of the aux run (TRL's default, None, takes the model's: 0.001)


def conversations(path: str, count: int) -> list[dict]:
    rows = [json.loads(line) for line in open(path)]
    return [{"messages": r["messages"]} for r in rows if "messages" in r][:count]


def train(a, *, aux: bool) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    name = "aux" if aux else "lora"
    ranks = 4  # the global batch is the same on 1 and 4 processes
    accumulation = GLOBAL_BATCH // (MICRO * ranks)
    if a.mode == "strategy":
        micro = MICRO * a.sp  # a sequence-parallel group shares its examples: world / sp data-parallel ranks
    elif aux:  # one micro-batch of the global batch: TRL's own aux loss is then the global batch's
        micro, accumulation = GLOBAL_BATCH, 1
    else:
        micro = MICRO * ranks  # one process takes the 4 ranks' micro-batches at once
    args = SFTConfig(
        output_dir=os.path.join(a.out, name), max_steps=STEPS, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, learning_rate=1e-2, max_grad_norm=0.5,
        logging_steps=1, save_steps=SAVE_STEP, save_strategy="no" if aux else "steps",
        train_sampling_strategy="sequential", use_cpu=True, report_to=[], seed=0,
        bf16=False,  # precision is the strategy's (mixed_precision)
        router_aux_loss_coef=AUX_COEF if aux else 0.0, disable_tqdm=True, dataset_num_proc=None, max_length=64)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    dataset = Dataset.from_list(conversations(a.dataset, STEPS * GLOBAL_BATCH))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    if a.mode == "strategy":
        strategy = NativeFSDPStrategy(ep_size=a.ep, sequence_parallel_size=a.sp, memory_efficient_init=True,
                                      mixed_precision="no", device_type="cpu")
        model = strategy.from_pretrained(a.model, dtype=torch.float32)
        trainer_class, extra = with_strategy(SFTTrainer), {"strategy": strategy}
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
        trainer_class, extra = SFTTrainer, {}
    torch.manual_seed(0)  # SFTTrainer applies peft_config at once: the same fresh adapter in every run
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=lora, **extra)
    trainer.train(resume_from_checkpoint=None if aux else a.resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {name: {
        "steps": [h["step"] for h in logs], "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
        "extra_fields": [{k: h.get(k) for k in ("tokens_per_second", "moe_load_imbalance", "mfu")} for h in logs]}}


def train_with_defaults(a, dtype) -> dict:
    """TRL's defaults, but bf16=False: precision is the strategy's (TrainingArguments.bf16 is refused)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    name = f"defaults_{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    # 4 rows a micro-batch: TRL logs the model's own aux loss of each micro-batch, where one token routed otherwise
    # in bf16 weighs 1 / its rows.
    args = SFTConfig(output_dir=os.path.join(a.out, name), max_steps=3, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, logging_steps=1, save_strategy="no", use_cpu=True, report_to=[],
                     seed=0, bf16=False, disable_tqdm=True, dataset_num_proc=None, max_length=64)
    strategy = NativeFSDPStrategy(ep_size=a.ep, memory_efficient_init=True, device_type="cpu",
                                  mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
    model = strategy.from_pretrained(a.model, dtype=dtype)
    trainer = with_strategy(SFTTrainer)(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(a.model),
                                        train_dataset=Dataset.from_list(conversations(a.dataset, 3 * 4 * 2 * 4)),
                                        strategy=strategy)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {name: {"steps": [h["step"] for h in logs], "losses": [h["loss"] for h in logs],
                   "aux_losses": [h.get("aux_loss") for h in logs], "coef": trainer.global_aux_loss.coef}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["strategy", "plain"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--sp", type=int, default=1)
    a = p.parse_args()
    assert int(os.environ.get("WORLD_SIZE", "1")) in (1, 4)  # the global batch is the same on 1 and 4 processes
    if a.resume:
        return train(a, aux=False)
    defaults = {}
    if a.mode == "strategy":
        defaults = {**train_with_defaults(a, torch.bfloat16), **train_with_defaults(a, torch.float32)}
    return {**train(a, aux=False), **train(a, aux=True), **defaults}


if __name__ == "__main__":
    worker_common.run(main)
