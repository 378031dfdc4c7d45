"""One process without torchrun, as `swift sft` runs on one device: twinkle-sft and a plain `python script.py`."""

import json
import os
import subprocess
import sys

from multinode import REPO, WORKERS

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "NPROC_PER_NODE", "NNODES", "NODE_RANK")


def plain_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}


def test_twinkle_sft_trains_in_one_process_without_torchrun(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "twinkle_strategy.train.cli", "--model", "tiny://demo",
                           "--dataset", DATASET, "--max_steps", "3", "--output_dir", str(out)],
                          cwd=tmp_path, env=plain_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in out.iterdir() if p.name.startswith("v")]
    with open(run_dir / "logging.jsonl") as f:
        steps = [json.loads(line)["global_step/max_steps"] for line in f]
    assert steps[-1] == "3/3", steps
    assert (run_dir / "checkpoint-3" / "trainer_state.json").is_file()


def test_a_plain_python_script_is_a_one_process_job(tmp_path):
    from twinkle_strategy.train.demo_model import prepare_demo_model

    model = prepare_demo_model(str(tmp_path / "model"), DATASET)
    proc = subprocess.run([sys.executable, str(WORKERS / "one_process.py"), "--model", model, "--dataset", DATASET,
                           "--output-dir", str(tmp_path / "out")], cwd=REPO, env=plain_env(TWINKLE_TEST_OUT=str(tmp_path)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    # An ep_size that needs more processes says, in one line, how to launch them.
    assert result["ep_error"] == ("ParallelConfigError: ep_size 2 needs 2 processes (or a multiple), this job has 1: "
                                  "launch them, e.g. torchrun --nproc_per_node 2 your_script.py (so that nodes x "
                                  "processes per node is a multiple of 2)")
    for path in ("plain", "memory_efficient_init"):  # the oracle: plain from_pretrained in the same process
        assert result[path]["compared"] > 10 and result[path]["differing"] == [], result[path]
        assert result[path]["logits_gap"] <= 1e-5, result[path]
    assert len(result["losses"]) == 2 and all(loss > 0 for loss in result["losses"]), result["losses"]
