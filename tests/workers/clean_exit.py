"""User scripts that end without ``strategy.shutdown()``, each run to a real interpreter exit, several times
(tests/multiproc/test_clean_exit.py).

Each rank of the launch (not forked from the suite's preload server, whose ranks end by ``os._exit``) imports once,
then forks one child per run: the children of the ranks form a process group of their own (a fresh port from rank
0), run a user's script body and end as a script does, through the interpreter's finalisation, where a gloo worker
still releasing its last collective aborted the process (``terminate called without an active exception``).
The rank records each child's exit status, and the child what it saw:

* ``grpo``: a user's GRPO script written from docs/rl.md, without ``use_cpu``: 2 ranks x 4 completions and
  ``num_generations=8`` (TRL counted 1 process and refused); on its first run, a ``GRPOConfig`` made before the
  strategy set up is refused in one line naming ``use_cpu``, before TRL's checks.
* ``sft``: ``with_strategy(SFTTrainer)`` with LoRA, without ``use_cpu``, a checkpoint at its last step: its
  ``logging.jsonl`` and what it printed at the end.
"""

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import worker_common  # noqa: E402

DATASET = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "demo_sft.jsonl")
CHILD_TIMEOUT_S = 120.0  # a run takes 10-20 s on 2 busy cores


def grpo(out: str, *, check_early_config: bool) -> dict:
    """A user's GRPO script (docs/rl.md's), on the demo model: no use_cpu, no shutdown()."""
    import re

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from twinkle_strategy import NativeFSDPStrategy, demo_model_path
    from twinkle_strategy.errors import ParallelConfigError
    from twinkle_strategy.integrations.transformers import with_strategy
    from twinkle_strategy.sources.demo import demo_conversations

    rows = {}
    for row in demo_conversations():
        question, answer = (m["content"] for m in row["messages"])
        if question.startswith("What is "):
            rows[question] = {"prompt": [{"role": "user", "content": question}], "answer": answer.split()[-1]}

    def reward(completions, answer, **_):
        return [float(bool(re.findall(r"-?\d+", c[-1]["content"])[-1:] == [a.rstrip(".")]))
                for c, a in zip(completions, answer, strict=True)]

    common = dict(output_dir=out, max_steps=2, per_device_train_batch_size=4, max_completion_length=4,
                  logging_steps=1, save_strategy="no", report_to=[], bf16=False, disable_tqdm=True)
    result = {}
    # Made before the strategy's setup: accelerate counts 1 process (4 completions, groups of 4: TRL accepts it).
    early = GRPOConfig(num_generations=4, **common) if check_early_config else None
    strategy = NativeFSDPStrategy(ep_size=2)
    model = strategy.from_pretrained(demo_model_path())
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    dataset = Dataset.from_list(list(rows.values()))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    if early is not None:
        try:
            with_strategy(GRPOTrainer)(model=model, args=early, reward_funcs=reward, train_dataset=dataset,
                                       processing_class=tokenizer, peft_config=lora, strategy=strategy)
            result["early_config"] = None
        except ParallelConfigError as exc:
            result["early_config"] = str(exc)
    config = GRPOConfig(num_generations=8, **common)  # 2 ranks x 4 completions: one group of 8
    trainer = with_strategy(GRPOTrainer)(model=model, args=config, reward_funcs=reward, train_dataset=dataset,
                                         processing_class=tokenizer, peft_config=lora, strategy=strategy)
    trainer.train()
    return {**result, "generation_batch_size": config.generation_batch_size, "use_cpu": config.use_cpu,
            "steps": [h["step"] for h in trainer.state.log_history if "loss" in h]}


def sft(out: str) -> dict:
    """A user's SFTTrainer script on the demo model: no use_cpu, no shutdown(); a checkpoint at its last step."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from twinkle_strategy import NativeFSDPStrategy, demo_model_path
    from twinkle_strategy.integrations.transformers import with_strategy

    strategy = NativeFSDPStrategy(ep_size=2)
    model = strategy.from_pretrained(demo_model_path())
    with open(DATASET) as f:
        rows = [json.loads(line) for line in f][:16]
    args = SFTConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, logging_steps=1, save_steps=2,
                     report_to=[], bf16=False, disable_tqdm=True, dataset_num_proc=None, max_length=64)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = with_strategy(SFTTrainer)(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                        processing_class=AutoTokenizer.from_pretrained(demo_model_path()),
                                        peft_config=lora, strategy=strategy)
    trainer.train()
    return {"steps": [h["step"] for h in trainer.state.log_history if "loss" in h], "use_cpu": args.use_cpu}


def collectives() -> dict:
    """A script whose last act is a collective on a gloo group made beside the process group (as ``any_rank``'s
    host group and the background saves' group are): the exit the abort is likeliest after, cheap enough to repeat."""
    import torch
    import torch.distributed as dist

    from twinkle_strategy import NativeFSDPStrategy

    strategy = NativeFSDPStrategy(device_type="cpu")
    strategy.setup()
    value = torch.ones(1)
    dist.all_reduce(value)
    gathered = [torch.empty(1) for _ in range(strategy.world_size)]
    dist.all_gather(gathered, value)
    side = dist.new_group(backend="gloo")
    dist.all_reduce(value, group=side)
    return {"sum": value.item()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_port(run: str, out: str) -> int:
    """A free port for ``run``'s process group, picked by rank 0 and read by the other ranks from a file."""
    path = os.path.join(out, f"{run}.port")
    if worker_common.rank() == 0:
        with open(path + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(path + ".tmp", path)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no port for {run}")
        time.sleep(0.05)
    with open(path) as f:
        return int(f.read())


def child(kind: str, run: str, out: str, first: bool) -> None:
    """The forked child: a user's script body in a process group of its own, then the interpreter's own end."""
    os.environ["MASTER_PORT"] = str(shared_port(run, out))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # the child's rank 0 hosts its group's store
    if kind == "grpo":
        result = grpo(os.path.join(out, run), check_early_config=first)
    elif kind == "sft":
        result = sft(os.path.join(out, run))
    else:
        result = collectives()
    with open(os.path.join(out, f"{run}.rank{worker_common.rank()}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    # The script ends here: no shutdown(), no destroy_process_group(); SystemExit unwinds to the interpreter's end.
    sys.exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=2, help="runs of each training script")
    p.add_argument("--collective-runs", type=int, default=6, help="runs of the collectives-only script")
    a = p.parse_args()
    out = os.environ["TWINKLE_TEST_OUT"]
    # Imported once here (the children are forks): what each child pays is its run, not the imports.
    import torch  # noqa: F401
    import trl  # noqa: F401
    from trl import GRPOTrainer, SFTTrainer  # noqa: F401

    import twinkle_strategy.integrations.transformers  # noqa: F401

    exits = []
    runs = [("grpo", index) for index in range(a.runs)] + [("sft", index) for index in range(a.runs)] + \
        [("collectives", index) for index in range(a.collective_runs)]
    runs.sort(key=lambda kind_index: kind_index[1])  # grpo0 sft0 collectives0 grpo1 ...
    for kind, index in runs:
        run = f"{kind}{index}"
        pid = os.fork()
        if pid == 0:
            try:
                child(kind, run, out, first=index == 0)
            except Exception:  # noqa: BLE001 - the child's own error, for the test to show (SystemExit passes)
                import traceback

                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
        code = wait_for(pid)  # -6: SIGABRT
        exits.append({"run": run, "exit": code})
        worker_common.write_result({"exits": exits})
        if code != 0:  # the next runs would only wait for this rank's peer: stop, the test shows why
            sys.exit(1)
    worker_common.write_result({"exits": exits, "done": True})


def wait_for(pid: int) -> int:
    """The child's exit code (negative: the signal that ended it); killed past CHILD_TIMEOUT_S (a peer that failed
    leaves it waiting in a collective)."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.1)


if __name__ == "__main__":
    main()
