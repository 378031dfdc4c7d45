"""The smoke subset in one launch: what a transformers/peft/torch release most often breaks, on every rank.

Run by tests/multiproc/test_smoke.py on the pinned set, on the oldest versions setup.py allows (.ci/run) and on the
newest releases (scripts/check_latest.sh). Each part reuses the worker of the full test, on fewer cases:

* ``init``: memory_efficient_init (streamed from hub-layout checkpoints, one of them in several files)
  against ``from_pretrained``, bit for bit (tests/workers/mem_init.py);
* ``bf16``: one bf16 parity case, DeepSeek-V3 with its fp32-kept router bias (tests/workers/bf16_parity.py);
* ``save_resume``: the Trainer saves a checkpoint at step 2 of 4, a second run resumes from it
  (tests/workers/save_resume.py);
* ``checkpointing``: two steps with and without activation checkpointing, LoRA on experts
  (tests/workers/long_runs.py).

A part that raises is recorded (``error``) and the next one runs, so one launch reports each part.
"""

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402

BUCKET = 4096


def init_case(path: str) -> dict:
    from mem_init import exact_mismatches, own_experts_ok, reference

    _, state, buffers = reference(path)
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=BUCKET / 2**20, timeout_s=300)
    model, _ = strategy.wrap_model(strategy.from_pretrained(path))
    got = strategy.full_state_dict(model)
    experts = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and strategy.ep_plan is not None
               and n in strategy.ep_plan.axes]
    return dict(path=os.path.basename(path), state_mismatches=exact_mismatches(got, state),
                buffer_mismatches=exact_mismatches({k: v.detach().clone() for k, v in model.named_buffers()}, buffers),
                own_experts_ok=own_experts_ok(strategy, model, state, worker_common.rank()), expert_params=len(experts),
                report=vars(strategy.init_report))


def bf16_case(path: str, world: int, rank: int) -> dict:
    from bf16_parity import run_case

    return run_case(path, "deepseek_v3", "full", 2, world, rank)


def save_resume_case(model: str, dataset: str, out: str) -> dict:
    from save_resume import train

    common = dict(model=model, dataset=dataset, ep=2, per_device=2, max_steps=4, bucket_bytes=BUCKET,
                  max_shard_size="64KB")
    first = train(argparse.Namespace(**common, output_dir=os.path.join(out, "run"), save_steps=2, resume=None))
    resumed = train(argparse.Namespace(**common, output_dir=os.path.join(out, "resumed"), save_steps=0,
                                       resume=os.path.join(out, "run", "checkpoint-2")))
    return dict(first=first, resumed=resumed, run_dir=os.path.join(out, "run"))


def checkpointing_case(model: str, dataset: str, out: str) -> dict:
    from long_runs import checkpointing_case
    from transformers import AutoTokenizer

    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset

    tokenizer = AutoTokenizer.from_pretrained(model)
    data = SFTDataset.from_jsonl(dataset, tokenizer, max_length=48)
    collator = DataCollatorForSFT(tokenizer.pad_token_id)
    args = argparse.Namespace(model=model, output_dir=out)
    return {f"gc{int(gc)}": checkpointing_case(args, data, collator, tokenizer, lora=True, gc=gc)
            for gc in (False, True)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="the demo model (hub layout, several files, with a tokenizer)")
    p.add_argument("--dataset", required=True)
    p.add_argument("--init-checkpoints", required=True, help="more checkpoints for the init part, comma-separated")
    p.add_argument("--bf16-checkpoint", required=True, help="DeepSeek-V3 as released (bf16, router bias in fp32)")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    parts = {
        "init": lambda: [init_case(path) for path in [args.model, *args.init_checkpoints.split(",")]],
        "bf16": lambda: bf16_case(args.bf16_checkpoint, world, rank),
        "save_resume": lambda: save_resume_case(args.model, args.dataset, os.path.join(args.output_dir, "save")),
        "checkpointing": lambda: checkpointing_case(args.model, args.dataset, os.path.join(args.output_dir, "gc")),
    }
    import transformers

    worker_common.write_result({"versions": {"torch": torch.__version__, "transformers": transformers.__version__}})
    failed = []
    for name, part in parts.items():
        start = time.perf_counter()
        try:
            result = {"result": part()}
        except Exception as exc:  # noqa: BLE001 - recorded for the test, the next part runs
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            failed.append(name)
        worker_common.write_result({name: {**result, "seconds": time.perf_counter() - start}})
    if failed:
        raise RuntimeError(f"smoke part(s) failed: {failed}")


if __name__ == "__main__":
    worker_common.run(main)
