"""TRL's GRPOTrainer with NativeFSDPStrategy: a verifiable reward, the policy generating its own rollouts on every
rank under EP + FSDP2, and rollout routing replay (R3) of what it generated.

The task: arithmetic questions (``What is 3 plus 4?``), the reward a function that checks the number in the answer.
On a cluster (run on each node, NODE_RANK 0 and 1)::

    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $MASTER --master_port 29500 \\
        examples/grpo.py --model Qwen/Qwen3-30B-A3B --ep-size 8 --bf16

On this machine (CPU, the embedded tiny Qwen3-MoE ``tiny://demo``, 2 simulated nodes x 2 ranks)::

    python examples/grpo.py --demo

``--dataset`` takes JSONL rows ``{"prompt": [{"role": "user", "content": ...}], "answer": "7"}``; without it the
arithmetic questions of the demo's data are used. Each log line carries ``reward``, ``routing_agreement_min`` and
``routing_agreement_mean`` (the share of tokens the trainer would have routed as the rollout did), and goes to
``<output-dir>/logging.jsonl``; at the end the script prints its output directory, last checkpoint and log file.
See docs/rl.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def arithmetic_prompts() -> list[dict]:
    """The demo data's ``What is A plus B?`` questions, once each, with their answers."""
    from twinkle_strategy.sources.demo import demo_conversations

    rows = {}
    for row in demo_conversations():
        question, answer = (m["content"] for m in row["messages"])
        if question.startswith("What is "):
            rows[question] = {"prompt": [{"role": "user", "content": question}],
                              "answer": answer.split()[-1].rstrip(".")}
    return list(rows.values())


def correct_answer(completions, answer, **_) -> list[float]:
    """1.0 when the completion's last number is the answer, else 0.0 (TRL passes the dataset's ``answer`` column)."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def train(args) -> None:
    from datasets import Dataset, load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    strategy = NativeFSDPStrategy(ep_size=args.ep_size, memory_efficient_init=True,
                                  mixed_precision="bf16" if args.bf16 else "no")
    model = strategy.from_pretrained(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(strategy.resolved_model_path(args.model))
    dataset = (load_dataset("json", data_files=args.dataset, split="train") if args.dataset
               else Dataset.from_list(arithmetic_prompts()))
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        learning_rate=1e-4 if not args.demo_lr else 5e-2, logging_steps=1, save_steps=args.max_steps, report_to=[],
        bf16=False,  # precision is the strategy's mixed_precision (FSDP2), not accelerate's autocast
        use_vllm=False)  # the policy generates on every rank (strategy.generate), recording what it routed
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = with_strategy(GRPOTrainer)(model=model, args=config, reward_funcs=correct_answer, train_dataset=dataset,
                                         processing_class=tokenizer, peft_config=lora, strategy=strategy,
                                         routing_replay="r3")
    trainer.train()  # logs to output_dir/logging.jsonl; at the end, prints where the checkpoints and the log are
    strategy.shutdown()  # optional: the strategy also tears down at exit


def demo() -> None:
    """Run this script on the tiny demo model as 2 simulated nodes x 2 ranks on this machine."""
    sys.path.insert(0, ROOT)
    from twinkle_strategy.train.launcher import run_demo

    run_demo(__file__, ["--model", "tiny://demo", "--max-steps", "4", "--batch-size", "2", "--demo-lr",
                        "--output-dir", os.path.join(ROOT, "output", "grpo")], repo_root=ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="the tiny demo model, 2 simulated nodes x 2 ranks on CPU")
    p.add_argument("--model", help="a local checkpoint, org/name or hf://org/name (the Hugging Face Hub), "
                                   "ms://org/name (ModelScope) or tiny://demo")
    p.add_argument("--dataset", help="JSONL rows with 'prompt' (messages) and 'answer' (default: the demo's sums)")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel size (default 2; a divisor of the world)")
    p.add_argument("--batch-size", type=int, default=4, help="completions per rank per step")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (one GRPO group)")
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--demo-lr", action="store_true", help=argparse.SUPPRESS)  # the tiny model moves in 4 steps
    p.add_argument("--output-dir", default="output/grpo")
    args = p.parse_args()
    if args.demo:
        return demo()
    if not args.model:
        p.error("--model is required (or --demo)")
    train(args)


if __name__ == "__main__":
    main()
