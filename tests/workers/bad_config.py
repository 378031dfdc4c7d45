"""Invalid sizes and models: every rank must raise the same clear error and exit.

Runs each case in turn and records its error; the case named by --fatal is
left uncaught, so the test also sees every process exit non-zero.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import worker_common  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402


def case_ep_not_dividing_world(args):
    NativeFSDPStrategy(ep_size=3, mixed_precision="no").setup()


def case_ep_fsdp_mismatch(args):
    NativeFSDPStrategy(ep_size=2, ep_fsdp_size=4, mixed_precision="no").setup()


def case_experts_not_divisible(args):
    s = NativeFSDPStrategy(ep_size=4, mixed_precision="no")
    s.wrap_model(s.from_pretrained(args.six_experts))


def case_dense_model_with_ep(args):
    s = NativeFSDPStrategy(ep_size=2, mixed_precision="no")
    s.wrap_model(s.from_pretrained(args.dense))


def _mem_init(path, dtype=None):
    import torch

    s = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, timeout_s=60)
    s.wrap_model(s.from_pretrained(path, dtype=dtype or torch.float32))


def case_missing_key(args):
    _mem_init(args.missing_key)


def case_wrong_shape(args):
    _mem_init(args.wrong_shape)


def case_corrupt_file(args):
    _mem_init(args.corrupt)


def case_missing_path(args):
    _mem_init("/nonexistent/model/dir")


def case_dtype_differs_on_node1(args):
    import torch

    # A launch bug: node 1's source loads bf16 while its other rank builds fp32.
    _mem_init(args.good, dtype=torch.bfloat16 if os.environ["RANK"] == "2" else torch.float32)


def case_hub_wrong_shape(args):
    _mem_init(args.hub_wrong_shape)


def case_hub_missing_key(args):
    _mem_init(args.hub_missing_key)


def case_hub_truncated(args):
    _mem_init(args.hub_truncated)


def case_output_dir_not_shared(args):
    from twinkle_strategy.train.trainer import Trainer, TrainingArguments

    # The test gives each simulated node its own directory, as nodes with local disks would have.
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", timeout_s=60)
    model = strategy.from_pretrained(args.good)
    Trainer(model=model, strategy=strategy, args=TrainingArguments(output_dir=os.environ["TWINKLE_TEST_NODE_DIR"]),
            train_dataset=[], data_collator=None).train()


def case_plain_setup(args):
    NativeFSDPStrategy(ep_size=1, mixed_precision="no").setup()


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--fatal", default=None)
    p.add_argument("--checkpoints", default="{}", help="JSON: case -> a broken checkpoint that memory_efficient_init "
                   "loads")
    p.add_argument("--six-experts")
    p.add_argument("--dense")
    for name in ("missing-key", "wrong-shape", "corrupt", "good", "hub-wrong-shape", "hub-missing-key",
                 "hub-truncated"):
        p.add_argument(f"--{name}")
    args = p.parse_args()
    checkpoints = json.loads(args.checkpoints)
    errors = {}
    for name in args.cases.split(","):
        try:
            _mem_init(checkpoints[name]) if name in checkpoints else CASES[name](args)
            errors[name] = None
        except Exception as exc:  # noqa: BLE001
            errors[name] = {"type": type(exc).__name__, "message": str(exc)}
        worker_common.write_result({"ok": True, "errors": errors})
    if args.fatal:  # every rank raises it; worker_common.run's wait keeps a slower rank from being stopped first
        CASES[args.fatal](args)
    return {"errors": errors}


if __name__ == "__main__":
    worker_common.run(main, failure_waits_for_every_rank_s=60)
