"""Train the embedded tiny Qwen3-MoE with EP + FSDP2 as 2 simulated nodes x 2 ranks on CPU.

    python examples/ep_fsdp_demo.py            # builds the checkpoint, launches 4 ranks, trains, saves

The model is a real transformers Qwen3MoeForCausalLM saved as safetensors; the
data is a learnable token pattern (each sequence counts upward from a random
start), so the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args) -> None:
    from twinkle_strategy import NativeFSDPStrategy

    strategy = NativeFSDPStrategy(ep_size=args.ep_size, mixed_precision="no")
    model = strategy.from_pretrained(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = strategy.wrap_model(model, optimizer)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1000 + strategy.rank)
    for step in range(1, args.steps + 1):
        start = torch.randint(0, vocab, (args.batch_size, 1), generator=generator)
        ids = (start + torch.arange(args.seq_len)) % vocab
        # The global mean per token over all ranks: each rank's loss is its share of it (README, "Lower level").
        count = strategy.global_loss_tokens(ids)
        share = model(input_ids=ids, labels=ids, num_items_in_batch=count).loss
        (share * strategy.world_size).backward()  # FSDP averages gradients over ranks
        norm = strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = strategy.reduce_sum(share)
        if strategy.is_main_process and (step == 1 or step % 5 == 0 or step == args.steps):
            print(f"step {step:3d}/{args.steps}  loss {mean_loss.item():.4f}  grad_norm {norm.item():.3f}", flush=True)
    state = strategy.full_state_dict(model, rank0_only=True)
    if strategy.is_main_process:
        from transformers import AutoConfig, AutoModelForCausalLM

        out = os.path.join(args.output_dir, "final")
        plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
        plain.load_state_dict(state)
        plain.save_pretrained(out)
        print(f"saved the trained model (experts gathered from all EP ranks) to {out}", flush=True)
    strategy.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default=os.path.join(ROOT, "output", "demo"))
    p.add_argument("--model", default=None, help="checkpoint to train (default: build the embedded tiny model)")
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint
    from twinkle_strategy.train.launcher import run_simulated_nodes

    if args.model is None:
        args.model = os.path.join(args.output_dir, "tiny-qwen3-moe")
        if not os.path.exists(os.path.join(args.model, "config.json")):
            save_tiny_checkpoint("qwen3_moe", args.model, seed=0, hidden_size=64, intermediate_size=32)
            print(f"built the embedded tiny Qwen3-MoE checkpoint in {args.model}")
    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    script = [os.path.abspath(__file__), "--worker", "--model", args.model, *forwarded]
    print(f"launching {args.nnodes} simulated nodes x {args.nproc_per_node} ranks, ep_size={args.ep_size}")
    result = run_simulated_nodes(script, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node,
                                 env={"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
