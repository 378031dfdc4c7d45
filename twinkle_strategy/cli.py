"""``twinkle-sft``: train from a YAML recipe and/or ``swift sft``-style flags.

    twinkle-sft yaml/demo.yaml train.max_steps=20
    twinkle-sft --model /models/Qwen3-30B-A3B --dataset data.jsonl --tuner_type lora \\
                --expert_parallel_size 8 --memory_efficient_init true --output_dir output
    NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 twinkle-sft ...

Flags keep the names of ``swift sft``; each maps to one recipe key (see
``--help``), and ``key=value`` overrides any recipe key. Like swift, when
NPROC_PER_NODE (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several
nodes) are set, the command re-launches itself under torchrun. Everything is
validated before any process or process group is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.recipe import Recipe, RecipeError, load_recipe
from twinkle_strategy.trainer import TrainingArguments

# swift sft flag -> recipe key, help
SWIFT_FLAGS: dict[str, tuple[str, str]] = {
    "model": ("model.path", "model dir, ms://org/name, hf://org/name or tiny://demo"),
    "torch_dtype": ("model.dtype", "float32 | bfloat16 | float16"),
    "dataset": ("data.dataset", "JSONL file ('messages' or 'query'/'response' rows)"),
    "max_length": ("data.max_length", "truncate examples to this many tokens"),
    "packing": ("data.packing", "pack examples into max_length sequences (true/false)"),
    "tuner_type": ("tuner.type", "lora | full"),
    "train_type": ("tuner.type", "alias of --tuner_type"),
    "lora_rank": ("tuner.lora_rank", "LoRA rank r"),
    "lora_alpha": ("tuner.lora_alpha", "LoRA alpha"),
    "target_modules": ("tuner.target_modules", "LoRA target modules (e.g. all-linear, or q_proj v_proj)"),
    "target_parameters": ("tuner.target_parameters", "LoRA on parameters, e.g. mlp.experts.gate_up_proj"),
    "expert_parallel_size": ("strategy.ep_size", "ranks that split each MoE layer's experts"),
    "expert_fsdp_size": ("strategy.ep_fsdp_size", "ranks sharding each expert slice (default world/ep)"),
    "memory_efficient_init": ("strategy.memory_efficient_init", "only each node's local rank 0 loads weights"),
    "stream_checkpoint": ("strategy.stream_checkpoint",
                          "with memory_efficient_init: read from the files only the rows each node keeps"),
    "mixed_precision": ("strategy.mixed_precision", "bf16 | fp16 | no"),
    "init_bucket_mb": ("strategy.init_bucket_mb", "memory_efficient_init transfer bucket size (MiB)"),
    "init_transport": ("strategy.init_transport", "p2p | scatter"),
    "verify_init": ("strategy.verify_init", "check a CRC32 of every region received at init"),
    "ddp_timeout": ("strategy.timeout_s", "seconds any collective may wait for a peer before failing"),
}
for _field in dataclasses.fields(TrainingArguments):
    SWIFT_FLAGS.setdefault(_field.name, (f"train.{_field.name}", f"training argument (default {_field.default})"))

LIST_KEYS = {"tuner.target_modules", "tuner.target_parameters"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="twinkle-sft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="YAML recipe (see yaml/); flags and key=value override it")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=20")
    parser.add_argument("--swift-plugin-path", action="store_true",
                        help="print the path of the ms-swift --external_plugins module and exit")
    group = parser.add_argument_group("swift sft compatible flags")
    for flag, (key, text) in SWIFT_FLAGS.items():
        group.add_argument(f"--{flag}", dest=flag, nargs="+" if key in LIST_KEYS else None, default=None,
                           metavar="V", help=f"{text} [{key}]")
    return parser


def parse(argv: list[str]) -> Recipe:
    args = build_parser().parse_args(argv)
    recipe_path, overrides = args.recipe, list(args.overrides)
    if recipe_path is not None and "=" in recipe_path:  # no YAML, only overrides
        overrides.insert(0, recipe_path)
        recipe_path = None
    flags = []
    for flag, (key, _) in SWIFT_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if key in LIST_KEYS:
            flags.append(f"{key}=[{','.join(value)}]")
        else:
            flags.append(f"{key}={value}")
    return load_recipe(recipe_path, flags + overrides)


def _launch_command(argv: list[str], recipe: Recipe) -> list[str] | None:
    """torchrun command to re-launch under, or None to train in this process."""
    env = os.environ
    if "LOCAL_RANK" in env:  # already a torchrun worker
        return None
    nproc = int(env.get("NPROC_PER_NODE", recipe.launch.nproc_per_node))
    nnodes = int(env.get("NNODES", recipe.launch.nnodes))
    if nproc * nnodes == 1:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", str(nnodes),
           "--node_rank", env.get("NODE_RANK", "0"), "--master_addr", env.get("MASTER_ADDR", "127.0.0.1"),
           "--master_port", env.get("MASTER_PORT", "29500")]
    return cmd + ["-m", "twinkle_strategy.cli", *argv]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--swift-plugin-path" in argv:
        # A path, not an import: importing the plugin would patch ms-swift in this process.
        print(os.path.join(os.path.dirname(os.path.abspath(__file__)), "swift_plugin.py"))
        return 0
    try:
        recipe = parse(argv)
    except (RecipeError, TwinkleError) as exc:
        print(f"twinkle-sft: error: {exc}", file=sys.stderr)
        return 2
    from twinkle_strategy.run import prepare_model_path

    if "LOCAL_RANK" not in os.environ:
        # Build the embedded model (tiny://) once here, before any worker starts.
        resolved = prepare_model_path(recipe.model.path, recipe.data.dataset)
        if resolved != recipe.model.path:
            argv = argv + [f"model.path={resolved}"]
            recipe.model.path = resolved
        if recipe.launch.simulated_nodes and recipe.launch.nnodes > 1:
            from twinkle_strategy.launcher import run_simulated_nodes

            print(f"twinkle-sft: {recipe.launch.nnodes} simulated nodes x {recipe.launch.nproc_per_node} ranks "
                  "on this machine", flush=True)
            # "-m": run as a module; running the file would shadow the stdlib with our platform.py.
            result = run_simulated_nodes(["-m", "twinkle_strategy.cli", *argv], nnodes=recipe.launch.nnodes,
                                         nproc_per_node=recipe.launch.nproc_per_node)
            return 0 if result.ok else 1
        cmd = _launch_command(argv, recipe)
        if cmd is not None:
            return subprocess.call(cmd)
    from twinkle_strategy.run import run_recipe

    run_recipe(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
