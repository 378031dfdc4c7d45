"""TRL's SFTTrainer with NativeFSDPStrategy: LoRA on attention and experts, ep_size=2, memory_efficient_init.

``--ep-size`` (default 2): each group of that many ranks splits every MoE layer's experts among
itself, and FSDP2 shards them further across the groups. On a cluster, 2 nodes x 8 GPUs, the experts of
Qwen3-30B-A3B are better spread over a whole node (run on each node, NODE_RANK 0 and 1)::

    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $MASTER --master_port 29500 \\
        examples/trl_sft.py --model Qwen/Qwen3-30B-A3B --dataset sft.jsonl --ep-size 8 --bf16

(``accelerate launch`` works as well, with a plain multi-GPU config: no DeepSpeed, no FSDP plugin.) A bare
``--model org/name`` comes from the Hugging Face Hub, as in transformers (``ms://org/name``: ModelScope).
On this machine (CPU, the embedded tiny Qwen3-MoE ``tiny://demo``, 2 simulated nodes x 2 ranks)::

    python examples/trl_sft.py --demo

The dataset is conversational JSONL (``{"messages": [{"role": ..., "content": ...}, ...]}``), read with
``datasets.load_dataset("json", ...)``. See docs/transformers.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(args) -> None:
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    # Only each node's local rank 0 reads the checkpoint; the other ranks build the model without weights and
    # receive exactly their shards when the trainer wraps it (EP, then FSDP2).
    strategy = NativeFSDPStrategy(ep_size=args.ep_size, memory_efficient_init=True,
                                  mixed_precision="bf16" if args.bf16 else "no")
    model = strategy.from_pretrained(args.model, dtype=torch.bfloat16 if args.bf16 else torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(strategy.resolved_model_path(args.model))
    dataset = load_dataset("json", data_files=args.dataset, split="train")
    config = SFTConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=1e-4, logging_steps=1, save_steps=args.max_steps, report_to=[],
        bf16=False)  # precision is the strategy's mixed_precision (FSDP2), not accelerate's autocast
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,  # dropout 0: LoRA on fused expert weights
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    trainer = with_strategy(SFTTrainer)(model=model, args=config, train_dataset=dataset,
                                        processing_class=tokenizer, peft_config=lora, strategy=strategy)
    trainer.train()  # logs to output_dir/logging.jsonl; at the end, prints where the checkpoints and the log are
    strategy.shutdown()  # optional: the strategy also tears down at exit


def demo() -> None:
    """Run this script on the tiny demo model as 2 simulated nodes x 2 ranks on this machine."""
    sys.path.insert(0, ROOT)
    from twinkle_strategy.train.launcher import run_demo

    dataset = os.path.join(ROOT, "examples", "data", "demo_sft.jsonl")
    run_demo(__file__, ["--model", "tiny://demo", "--dataset", dataset, "--max-steps", "5",
                        "--output-dir", os.path.join(ROOT, "output", "trl_sft")], repo_root=ROOT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="the tiny demo model, 2 simulated nodes x 2 ranks on CPU")
    p.add_argument("--model", help="a local checkpoint, org/name or hf://org/name (the Hugging Face Hub), "
                                   "ms://org/name (ModelScope) or tiny://demo")
    p.add_argument("--dataset", help="conversational JSONL")
    p.add_argument("--ep-size", type=int, default=2, help="expert-parallel size (default 2; a divisor of the world)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--output-dir", default="output/trl_sft")
    args = p.parse_args()
    if args.demo:
        return demo()
    if not (args.model and args.dataset):
        p.error("--model and --dataset are required (or --demo)")
    train(args)


if __name__ == "__main__":
    main()
