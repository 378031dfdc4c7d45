"""The one-process 3-step demo run of the README against a plain transformers + PEFT script doing the same, in wall
time: the bound "at most 2.5x the plain script" (issue 45).

    python benchmarks/demo_wall.py --repeat 5        # the reported run (~2 min here)
    python benchmarks/demo_wall.py --repeat 1        # smoke run

Each round runs, as fresh processes from the checkout's root, one after the other (the order alternating between
rounds, so that a load on the machine falls on both):

  twinkle-sft   ``twinkle-sft --model tiny://demo --dataset examples/data/demo_sft.jsonl --max_steps 3`` (the
                README's one-process command), into a fresh output directory
  plain         ``benchmarks/plain_demo_sft.py``: the same checkpoint, tokens, LoRA, optimizer, schedule and steps,
                written with transformers and PEFT alone, saving the adapter, tokenizer and optimizer state
  imports       ``python -c "import torch, transformers, peft"``: what any such script pays before its first line

The demo model (``output/tiny/demo``, built on first use) is built before the first round, so no round pays for it.
Reported: the median wall time of each over the rounds, the ratio twinkle-sft / plain, and where twinkle-sft's time
goes: the parts of its start line (``start(s)`` and ``start_parts(s)`` of the first logging.jsonl entry, from the
process's start to the end of the first step) and the rest (two more steps, the save, the plots, the exit). The
first step's loss of both, which must be the same (the same rows, the same fresh adapter).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench_io import command_line, write_results  # noqa: E402

DATASET = "examples/data/demo_sft.jsonl"
STEPS = 3
BOUND = 2.5  # issue 45: at most this many times the plain script's wall time


@dataclasses.dataclass
class Round:
    twinkle_s: float
    plain_s: float
    imports_s: float
    start_s: float  # twinkle-sft's start line: process start to the end of the first step
    start_parts_s: dict[str, float]
    twinkle_first_loss: float
    plain_first_loss: float


def twinkle_sft_command(output_dir: str) -> list[str]:
    """The README's command; the console script when it is installed beside this Python (what a user runs)."""
    script = os.path.join(os.path.dirname(sys.executable), "twinkle-sft")
    entry = [script] if os.path.exists(script) else [sys.executable, "-m", "twinkle_strategy.train.cli"]
    return entry + ["--model", "tiny://demo", "--dataset", DATASET, "--max_steps", str(STEPS),
                    "--output_dir", output_dir]


def plain_command(model_path: str, output_dir: str) -> list[str]:
    return [sys.executable, os.path.join(HERE, "plain_demo_sft.py"), "--model", model_path, "--dataset", DATASET,
            "--max-steps", str(STEPS), "--output-dir", output_dir]


IMPORTS_COMMAND = [sys.executable, "-c", "import torch, transformers, peft"]


@dataclasses.dataclass(frozen=True)
class Finished:
    seconds: float  # wall time, from start to exit
    stdout: str


def timed(command: list[str]) -> Finished:
    """``command`` run from the checkout's root (it must succeed): its wall time and standard output."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return Finished(seconds, done.stdout)


def first_log_entry(output_dir: str) -> dict:
    (path,) = glob.glob(os.path.join(output_dir, "v*", "logging.jsonl"))
    with open(path) as f:
        return json.loads(f.readline())


def one_round(index: int, model_path: str, scratch: str) -> Round:
    twinkle_dir, plain_dir = os.path.join(scratch, f"twinkle{index}"), os.path.join(scratch, f"plain{index}")
    runs = {"twinkle": lambda: timed(twinkle_sft_command(twinkle_dir)),
            "plain": lambda: timed(plain_command(model_path, plain_dir)),
            "imports": lambda: timed(IMPORTS_COMMAND)}
    order = list(runs) if index % 2 == 0 else list(reversed(runs))
    measured = {name: runs[name]() for name in order}
    entry = first_log_entry(twinkle_dir)
    plain = json.loads(measured["plain"].stdout.strip().splitlines()[-1])  # its last line: the losses
    return Round(twinkle_s=measured["twinkle"].seconds, plain_s=measured["plain"].seconds,
                 imports_s=measured["imports"].seconds,
                 start_s=entry["start(s)"], start_parts_s=entry["start_parts(s)"],
                 twinkle_first_loss=entry["loss"], plain_first_loss=plain["losses"][0])


def render(rounds: list[Round], header: str) -> str:
    def median(values) -> float:
        return statistics.median(values)

    def span(values) -> str:
        return f"{median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    twinkle, plain, imports = ([getattr(r, k) for r in rounds] for k in ("twinkle_s", "plain_s", "imports_s"))
    ratio = median(twinkle) / median(plain)
    ratios = [t / p for t, p in zip(twinkle, plain, strict=True)]
    parts = {name: median([r.start_parts_s.get(name, 0.0) for r in rounds]) for name in rounds[0].start_parts_s}
    rest = median([r.twinkle_s - r.start_s for r in rounds])
    lines = [header, "",
             "| run | wall s, median (range) | vs plain |", "|---|---|---|",
             f"| twinkle-sft, one process, {STEPS} steps | {span(twinkle)} | **{ratio:.2f}x** "
             f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x; bound {BOUND}x) |",
             f"| plain transformers + PEFT script | {span(plain)} | 1.00x |",
             f"| `import torch, transformers, peft` alone | {span(imports)} | {median(imports) / median(plain):.2f}x |",
             "", "twinkle-sft's wall time, medians: its start line (process start to the end of the first step) "
             f"{median([r.start_s for r in rounds]):.2f} s = "
             + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
             + f"; then {rest:.2f} s (steps 2-{STEPS}, the save, the plots, the exit). One process trains in the "
             "launcher's own process, so its launch is Python's start, every import (torch, transformers and this "
             "package's) and the recipe's checks; init includes PEFT's import.", "",
             f"First step's loss: twinkle-sft {rounds[0].twinkle_first_loss:.6f}, plain "
             f"{rounds[0].plain_first_loss:.6f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="rounds (medians are reported)")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--no-write", dest="write", action="store_false", help="print only")
    parser.add_argument("--render", metavar="JSON", help="re-make the table from a results JSON, no run")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        text = render([Round(**r) for r in saved["rounds"]], saved["header"])
        print(text)
        write_results(os.path.dirname(os.path.abspath(args.render)), "demo_wall", text=text, payload=saved)
        return
    from twinkle_strategy.train.run import prepare_model_path

    load_before = os.getloadavg()[0]  # the machine's load (other jobs share it): said beside the figures
    cwd = os.getcwd()
    os.chdir(ROOT)  # twinkle-sft builds tiny://demo under ./output/tiny: the same place, built once, untimed
    try:
        model_path = prepare_model_path("tiny://demo", [DATASET])
    finally:
        os.chdir(cwd)
    with tempfile.TemporaryDirectory() as scratch:
        rounds = []
        for index in range(args.repeat):
            rounds.append(one_round(index, model_path, scratch))
            print(json.dumps(dataclasses.asdict(rounds[-1])), flush=True)
    header = (f"Command: `{command_line('demo_wall.py')}`; {args.repeat} round(s) on this machine (load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after), "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; twinkle-sft: "
              f"`twinkle-sft --model tiny://demo --dataset {DATASET} --max_steps {STEPS}`.")
    text = render(rounds, header)
    print(text)
    if args.write:
        write_results(args.out, "demo_wall", text=text, payload={"command": command_line("demo_wall.py"),
                                                                 "header": header,
                                                                 "rounds": [dataclasses.asdict(r) for r in rounds]})


if __name__ == "__main__":
    main()
