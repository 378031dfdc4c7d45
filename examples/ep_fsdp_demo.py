"""Train the embedded tiny Qwen3-MoE with EP + FSDP2 + memory_efficient_init as 2 simulated nodes x 2 ranks on CPU.

    bash scripts/demo.sh                        # once: creates .venv (torch + this package) and runs the CLI demo
    .venv/bin/python examples/ep_fsdp_demo.py   # builds the checkpoint, launches 4 ranks, trains, saves

``python examples/ep_fsdp_demo.py`` works too: an interpreter without torch hands the run to the
checkout's ``.venv/bin/python`` (or, with no ``.venv``, says in one line how to create it).

The model is a real transformers Qwen3MoeForCausalLM saved as safetensors. With memory_efficient_init
each node's local rank 0 reads it and every other rank receives only its own shard. The data is a
learnable token pattern (each sequence counts upward from a random start), so the loss visibly falls
within a few dozen steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = os.path.join(ROOT, ".venv", "bin", "python")


def _run_where_torch_is() -> None:
    """Outside the project's virtualenv (no torch here): run this script with .venv's interpreter instead."""
    if importlib.util.find_spec("torch") is not None:
        sys.path.insert(0, ROOT)  # this checkout's twinkle_strategy, also when it is not installed
        return
    if os.access(VENV_PYTHON, os.X_OK) and os.path.realpath(sys.executable) != os.path.realpath(VENV_PYTHON):
        os.execv(VENV_PYTHON, [VENV_PYTHON, os.path.abspath(__file__), *sys.argv[1:]])
    print(f"ep_fsdp_demo.py: torch is not installed for {sys.executable} and {VENV_PYTHON} does not exist; "
          f"create it once with `bash {os.path.join(ROOT, 'scripts', 'demo.sh')}`, then run "
          f"`{VENV_PYTHON} {os.path.abspath(__file__)}`", file=sys.stderr)
    sys.exit(2)


def worker(args) -> None:
    import torch

    from twinkle_strategy import NativeFSDPStrategy

    # memory_efficient_init: only each node's local rank 0 reads the checkpoint; the others build the model on
    # the meta device, and wrap_model gives every rank exactly its shard.
    strategy = NativeFSDPStrategy(ep_size=args.ep_size, mixed_precision="no", memory_efficient_init=True)
    model = strategy.from_pretrained(args.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = strategy.wrap_model(model, optimizer)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1000 + strategy.rank)
    for step in range(1, args.steps + 1):
        start = torch.randint(0, vocab, (args.batch_size, 1), generator=generator)
        ids = (start + torch.arange(args.seq_len)) % vocab
        # The global mean per token over all ranks: each rank's loss is its share of it (README, "Lower level").
        batch = {"input_ids": ids, "labels": ids}
        count = strategy.global_loss_tokens(batch)
        share = model(**batch, num_items_in_batch=count).loss
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
    _run_where_torch_is()
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
