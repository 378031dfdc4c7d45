"""NativeFSDPStrategy inside transformers.Trainer (twinkle_strategy.integrations.transformers).

One launch on 2 simulated nodes x 2 ranks (ep_size=2, memory_efficient_init) trains a LoRA run
(attention and experts) and then a full-parameter run; one plain process runs plain
``transformers.Trainer`` on the same global batches. Per-step losses and gradient norms must agree
(fp32), and the saved checkpoints must load with plain PEFT / transformers and give the logits
the plain run's saved checkpoints give. A third, full-parameter run with the model's load-balancing loss
on must count it over the global batch: the plain process takes the global batch in one micro-batch.
The same launch then runs the LoRA run again with ``async_save=True``: training goes on while its checkpoint is
written, and the files equal the synchronous run's. A DeepSpeed ZeRO-3 config next to the strategy must end
every rank with one line naming it, before any weight is read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multinode import REPO, WORKERS, launch

from twinkle_strategy.errors import ConflictingShardingError
from twinkle_strategy.integrations.transformers import refuse_conflicting_sharding
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

ATOL = 1e-5  # fp32, as one process


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("hf_trainer") / "model"))


def _plain(model: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWINKLE_TEST_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(WORKERS / "hf_trainer.py"), "--mode", "plain", "--model", model,
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "rank0.json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_trainer_runs")
    result = launch("hf_trainer.py", ["--mode", "strategy", "--model", tiny_model, "--out", str(root / "strategy")],
                    root / "strategy", nnodes=2, nproc_per_node=2, timeout=400)
    assert result.ok(), result.describe()
    return {"strategy": result.rank_results(), "plain": _plain(tiny_model, root / "plain")}


@pytest.mark.parametrize("run", ["lora", "full", "aux"])
def test_hf_trainer_matches_one_process_plain_trainer(runs, run):
    plain = runs["plain"][run]
    for rank, result in runs["strategy"].items():
        assert len(result[run]["losses"]) == len(plain["losses"]) == 3
        torch.testing.assert_close(result[run]["losses"], plain["losses"], atol=ATOL, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        torch.testing.assert_close(result[run]["grad_norms"], plain["grad_norms"], atol=ATOL, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r} gradient norms: {m}")


@pytest.mark.parametrize("run", ["lora", "full"])
def test_hf_trainer_saves_what_plain_peft_and_transformers_load(runs, run):
    # The 2x2 ep=2 run's checkpoint, loaded on one process by plain PEFT (the full [r*E] expert adapter) or
    # plain from_pretrained, gives the logits of the one-process run's checkpoint.
    torch.testing.assert_close(torch.tensor(runs["strategy"][0][run]["saved_logits"]),
                               torch.tensor(runs["plain"][run]["saved_logits"]), atol=ATOL, rtol=0)


def test_hf_trainer_async_save_overlaps_training_and_writes_the_synchronous_files(runs):
    for rank, result in runs["strategy"].items():
        run, sync = result["lora_async"], result["lora"]
        assert run["losses"] == sync["losses"] and run["grad_norms"] == sync["grad_norms"], rank
        # The writer paused mid-file in checkpoint-2 until step 3 began: step 3 started before any of
        # checkpoint-2's files was durable, by the writers' own timestamps.
        written = run["writes"]["checkpoint-2"]
        assert written and run["step_starts"]["3"] < min(t["durable"] for t in written.values()), (rank, run)
        assert list(run["writes"]) == ["checkpoint-2", "checkpoint-3"], rank  # the final save, awaited in train()
        # save_total_limit=1: checkpoint-2 went once checkpoint-3 was durable; no staging directory is left.
        assert run["left"] == ["checkpoint-3"], (rank, run["left"])
    run = runs["strategy"][0]["lora_async"]
    assert run["different"] == [] and run["compared"] > 10, run  # adapter, trainer_state/, RNG, arguments


def test_deepspeed_zero3_next_to_the_strategy_stops_every_rank_before_weights_load(tiny_model, tmp_path):
    result = launch("hf_trainer.py", ["--mode", "refuse", "--model", tiny_model, "--out", str(tmp_path)],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=120)
    assert not result.timed_out and all(rc != 0 for rc in result.returncodes), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for rank, data in ranks.items():
        assert data["error_type"] == "ConflictingShardingError", (rank, data.get("traceback"))
        assert "TrainingArguments.deepspeed" in data["error"] and "ZeRO-3" in data["error"], data["error"]
        assert "\n" not in data["error"]
        assert data["init_report_before"] is False  # no rank had received a weight


def test_accelerate_launch_with_deepspeed_or_fsdp_is_refused(tmp_path):
    config = tmp_path / "ds_zero3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConflictingShardingError, match=r"DeepSpeed ZeRO-3 \(ACCELERATE_USE_DEEPSPEED=true\)"):
        refuse_conflicting_sharding(environ={"ACCELERATE_USE_DEEPSPEED": "true",
                                             "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    with pytest.raises(ConflictingShardingError, match="ACCELERATE_USE_FSDP=true"):
        refuse_conflicting_sharding(environ={"ACCELERATE_USE_FSDP": "true"})
    refuse_conflicting_sharding(environ={"ACCELERATE_USE_DEEPSPEED": "false"})  # what `accelerate launch` sets


def test_a_model_transformers_sharded_at_load_is_refused(tiny_model):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.integrations.transformers import refuse_transformers_expert_parallel

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    refuse_transformers_expert_parallel(model)
    # What from_pretrained(distributed_config=DistributedConfig(enable_expert_parallel=True)) marks its models with.
    model._is_distributed_loading_by_transformers = True  # (behind the public is_distributed_loading_by_transformers)
    with pytest.raises(ConflictingShardingError, match=r"distributed_config=.*NativeFSDPStrategy.from_pretrained"):
        refuse_transformers_expert_parallel(model)
