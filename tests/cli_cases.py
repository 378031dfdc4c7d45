"""The twinkle-sft command lines several test files share: the demo recipe and data, datasets with bad rows, a
CLI run as a subprocess, and the one-line mistakes with their fixes (tests/unit/test_launch_error_lines.py checks
each before launch, tests/multiproc/test_launch_errors.py launches the fixes)."""

import json
import os
import subprocess
from pathlib import Path

from multinode import REPO
from preload import cli_command, cli_env

DEMO = str(REPO / "yaml" / "demo.yaml")
DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")


def demo_rows(count):
    with open(DATASET) as f:
        return [json.loads(line) for line in f][:count]


def write_rows(path, rows):
    """``rows``: dicts (written as JSON) or strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


TOO_LONG = (r"\d+ tokens, longer than max_length=64 \(swift's default truncation_strategy delete drops such rows; "
            r"raise data.max_length, or set data.truncation_strategy=right to cut them\)")


def twenty_rows_three_bad(path):
    """Rows 4 (not JSON), 9 (no assistant turn) and 15 (longer than max_length 64: dropped, as swift drops it)
    are bad."""
    rows = demo_rows(20)
    rows[3] = '{"query": "What is 2 plus 2?", "response": '
    rows[8] = {"messages": [{"role": "user", "content": "What is 3 plus 3?"}]}
    rows[14] = {"query": "What is 1 plus 1? " * 30, "response": "1 plus 1 is 2."}
    return write_rows(path, rows)


def run_cli(args, cwd, env=None):
    # No MASTER_PORT: a one-node twinkle-sft picks a free one itself, and picks again if another run takes it.
    env = cli_env({**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1",
                   "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    return subprocess.run([*cli_command(env), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def only_run_dir(output_dir):
    runs = [p for p in Path(output_dir).iterdir() if p.name.startswith("v")]
    assert len(runs) == 1, runs
    return runs[0]

MISTAKES = [
    (["--max_stepz", "3"], "unknown flag --max_stepz; did you mean --max_steps?", ["--max_steps", "3"]),
    # No prefix matching: argparse used to take --max_step for --max_steps, silently.
    (["--max_step", "3"], "unknown flag --max_step; did you mean --max_steps?", ["--max_steps", "3"]),
    (["--max_steps", "3", "--deepspeed", "zero3"], "swift's --deepspeed is not a twinkle-sft flag: twinkle-sft "
                                                   "shards with FSDP2 and expert parallelism itself; drop it "
                                                   "(twinkle-sft --help lists the strategy flags, e.g. "
                                                   "--expert_parallel_size)", ["--max_steps", "3"]),
    (["--learning_rate", "fast"], "train.learning_rate (--learning_rate): 'fast' is not a number; "
                                  "e.g. --learning_rate 0.0001", ["--learning_rate", "0.0001"]),
    (["train.learning_rate=fast"], "train.learning_rate (--learning_rate): 'fast' is not a number; "
                                   "e.g. train.learning_rate=0.0001", ["train.learning_rate=0.0001"]),
    (["--seed", "1.5"], "train.seed (--seed): '1.5' is not an integer; e.g. --seed 42", ["--seed", "42"]),
    (["train.max_stpes=3"], "unknown recipe key 'train.max_stpes' in train.max_stpes=3; did you mean train.max_steps?",
     ["train.max_steps=3"]),
    # 8 experts (tiny://demo's), ep 3 in a world of 3: used to fail after launch in 28 lines.
    (["launch.nnodes=1", "launch.nproc_per_node=3", "--expert_parallel_size", "3"],
     "strategy.ep_size (--expert_parallel_size): tiny://demo has 8 experts, not divisible by ep_size 3; "
     "choose ep_size among [1]", ["launch.nnodes=1", "launch.nproc_per_node=3", "--expert_parallel_size", "1"]),
    (["strategy.ep_size=8"], "strategy.ep_size (--expert_parallel_size): ep_size 8 needs a multiple of 8 "
                             "processes, this run has 4 (nodes x processes per node = 2 x 2); set "
                             "launch.nproc_per_node=4, or ep_size among [1, 2, 4]",
     ["strategy.ep_size=8", "launch.nproc_per_node=4"]),
    # Every row truncated to nothing: used to fail after launch with a misleading "Rows need 'messages'" tail.
    (["data.max_length=8"], "data.max_length (--max_length): max_length=8 drops every row as longer "
                            "(truncation_strategy delete, swift's default); the first 100 rows of each dataset need "
                            "up to 37 tokens: raise it, e.g. --max_length 37", ["--max_length", "37"]),
    # Cut instead (swift's --truncation_strategy right): every row's response is cut off.
    (["data.max_length=8", "--truncation_strategy", "right"],
     "data.max_length (--max_length): max_length=8 truncates every row to nothing to train on; the first 100 rows of "
     "each dataset need up to 37 tokens: raise it, e.g. --max_length 37",
     ["--max_length", "37", "--truncation_strategy", "right"]),
    # swift's truncation_strategy split is for pre-training.
    (["--truncation_strategy", "split"], "data.truncation_strategy (--truncation_strategy): 'split' ('split' is "
                                         "swift's for pre-training); use delete (swift's default), right or left",
     ["--truncation_strategy", "left"]),
    (["--lora_dropout", "0.05"], "tuner.lora_dropout (--lora_dropout): tuner.lora_dropout=0.05 cannot be used with "
                                 "tuner.target_parameters=['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'] (LoRA "
                                 "on fused expert weights): set tuner.lora_dropout=0, or set tuner.target_parameters=[] "
                                 "to train attention/linear layers only",
     ["--lora_dropout", "0.05", "tuner.target_parameters=[]"]),
    # all-linear (the default without a recipe) on the demo's MoE: PEFT used to refuse it after launch.
    (["--lora_dropout", "0.05", "tuner.target_modules=[all-linear]", "tuner.target_parameters=[]"],
     "tuner.lora_dropout (--lora_dropout): tuner.lora_dropout=0.05 cannot be used with "
     "tuner.target_modules=['all-linear'] (PEFT puts it on the fused expert weights) (LoRA on fused expert "
     "weights): set tuner.lora_dropout=0, or set tuner.target_modules=[q_proj,k_proj,v_proj,o_proj] to train "
     "attention/linear layers only",
     ["--lora_dropout", "0.05", "tuner.target_parameters=[]", "tuner.target_modules=[q_proj,k_proj,v_proj,o_proj]"]),
    # One node: the fix is the run test_the_suggested_fixes_start_the_run launches.
    (["launch.nnodes=1", "launch.nproc_per_node=1", "strategy.ep_size=2"],
     "strategy.ep_size (--expert_parallel_size): ep_size 2 needs a multiple of 2 processes, this run has 1 (nodes "
     "x processes per node = 1 x 1); set launch.nproc_per_node=2, or ep_size among [1]",
     ["launch.nnodes=1", "launch.nproc_per_node=2", "strategy.ep_size=2"]),
    # ep 3 in a world of 1: the divisibility by the 8 experts comes first (the world-size fix, 3 processes,
    # used to be suggested here and then failed on the experts).
    (["launch.nnodes=1", "launch.nproc_per_node=1", "strategy.ep_size=3"],
     "strategy.ep_size (--expert_parallel_size): tiny://demo has 8 experts, not divisible by ep_size 3; "
     "choose ep_size among [1]", ["launch.nnodes=1", "launch.nproc_per_node=1", "strategy.ep_size=1"]),
    # 3 nodes: processes per node for a world divisible by ep (ceil(ep / nodes) = 1 used to be suggested).
    (["launch.nnodes=3", "launch.nproc_per_node=1", "strategy.ep_size=2"],
     "strategy.ep_size (--expert_parallel_size): ep_size 2 needs a multiple of 2 processes, this run has 3 (nodes "
     "x processes per node = 3 x 1); set launch.nproc_per_node=2, or ep_size among [1]",
     ["launch.nnodes=3", "launch.nproc_per_node=2", "strategy.ep_size=2"]),
    # ep and sp both misfit: the suggested world fits both (lcm 4), and ep x sp = 8 may exceed it (issue 27); the
    # line names both sizes, keys and flags.
    (["launch.nnodes=1", "launch.nproc_per_node=3", "strategy.ep_size=2", "--sequence_parallel_size", "4"],
     "strategy.ep_size (--expert_parallel_size): ep_size 2 and sequence_parallel_size 4 (strategy.sequence_parallel_"
     "size, --sequence_parallel_size) must each divide the number of processes (SP groups sit inside the data-"
     "parallel and EP ranks, so ep x sp may exceed it), this run has 3 (nodes x processes per node = 1 x 3); set "
     "launch.nproc_per_node=4, or ep_size among [1] and sequence_parallel_size among [1]",
     ["launch.nnodes=1", "launch.nproc_per_node=4", "strategy.ep_size=2", "--sequence_parallel_size", "4"]),
    # The issue's own: ep_size 8 (the 8 experts of tiny://demo) in a world of 4; the fix it once suggested,
    # NPROC_PER_NODE=8, lost to the recipe's launch section.
    (["launch.nnodes=1", "launch.nproc_per_node=4", "strategy.ep_size=8"],
     "strategy.ep_size (--expert_parallel_size): ep_size 8 needs a multiple of 8 processes, this run has 4 (nodes "
     "x processes per node = 1 x 4); set launch.nproc_per_node=8, or ep_size among [1, 2, 4]",
     ["launch.nnodes=1", "launch.nproc_per_node=8", "strategy.ep_size=8"]),
]
MISTAKE_IDS = ["unknown-flag", "prefix", "swift-only", "type-of-flag", "type-of-key", "int", "unknown-key", "experts",
               "world-size", "max-length", "max-length-cut", "truncation-split", "lora-dropout", "lora-dropout-all-linear", "world-size-one-node",
               "experts-before-world", "world-size-three-nodes", "world-size-ep-and-sp", "world-size-issue-31"]
# What each line tells the user to do, which its fix does.
FIX_SAID = {"unknown-flag": "did you mean --max_steps?", "prefix": "did you mean --max_steps?", "swift-only": "drop it",
            "type-of-flag": "e.g. --learning_rate 0.0001", "type-of-key": "e.g. train.learning_rate=0.0001",
            "int": "e.g. --seed 42", "unknown-key": "did you mean train.max_steps?",
            "experts": "choose ep_size among [1]", "world-size": "set launch.nproc_per_node=4",
            "max-length": "e.g. --max_length 37", "max-length-cut": "e.g. --max_length 37",
            "truncation-split": "use delete (swift's default), right or left", "lora-dropout": "set tuner.target_parameters=[]",
            "lora-dropout-all-linear": "set tuner.target_modules=[q_proj,k_proj,v_proj,o_proj]",
            "world-size-one-node": "set launch.nproc_per_node=2", "experts-before-world": "choose ep_size among [1]",
            "world-size-three-nodes": "set launch.nproc_per_node=2", "world-size-ep-and-sp": "set launch.nproc_per_node=4",
            "world-size-issue-31": "set launch.nproc_per_node=8"}
# The launches that prove the fixes start the run (issue 31: "each suggested fix is then applied and the run
# starts"): (world size, the fixes applied together). Fixes of a kind launched already are in SAME_KIND.
FIX_LAUNCHES = [
    (1, ["unknown-flag", "prefix", "swift-only", "type-of-flag", "type-of-key", "int", "unknown-key", "max-length",
         "lora-dropout", "lora-dropout-all-linear", "experts-before-world"]),
    (8, ["world-size-issue-31"]),  # 1 node x 8, ep 8
    (4, ["world-size-ep-and-sp", "truncation-split"]),  # 1 node x 4, ep 2, sp 4, rows cut on the left
]
SAME_KIND = {"experts": "experts-before-world",  # ep_size among [1], there in a world of 3
             "max-length-cut": "max-length",  # --max_length 37, there with rows cut instead of dropped
             # launch.nproc_per_node=N, N from processes_per_node_for, there on 2 and 3 (simulated) nodes and on 1
             "world-size": "world-size-issue-31", "world-size-three-nodes": "world-size-issue-31",
             "world-size-one-node": "world-size-issue-31"}
