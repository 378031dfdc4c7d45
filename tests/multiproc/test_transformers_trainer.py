"""NativeFSDPStrategy inside transformers.Trainer (twinkle_strategy.integrations.transformers).

One launch on 2 simulated nodes x 2 ranks (ep_size=2, memory_efficient_init) trains a LoRA run
(attention and experts) and then a full-parameter run; one plain process runs plain
``transformers.Trainer`` on the same global batches. Per-step losses and gradient norms must agree
(fp32), and the saved checkpoints must load with plain PEFT / transformers and give the logits
the plain run's saved checkpoints give. A third, full-parameter run with the model's load-balancing loss
on must count it over the global batch: the plain process takes the global batch in one micro-batch.
Two more runs train on packed rows (DataCollatorWithFlattening), the plain process with the KV cache off: LoRA,
and full-parameter with the aux loss and sequence_parallel_size=2 (each rank a chunk of its group's rows).
The same launch then runs the LoRA run again with ``async_save=True``: training goes on while its
checkpoint is written, and the files equal the synchronous run's.
A DeepSpeed ZeRO-3 setting next to the strategy must end every rank with one line naming it, within seconds:
accelerate's (its launcher's environment) in from_pretrained before the process group and any file is read,
TrainingArguments' when the trainer is built, before any weight moves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from multinode import REPO, WORKERS, launch

from twinkle_strategy.errors import ConflictingShardingError
from twinkle_strategy.integrations.transformers import refuse_conflicting_sharding
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

ATOL = 1e-5  # fp32, as one process
REFUSAL_SPREAD_S = 20  # first refusal to the end of the launch (measured: ranks within 0.02 s, logs closed 0.4 s later)


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


@pytest.mark.parametrize("run", ["lora", "full", "aux", "packed", "sp"])
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
        # save_total_limit=1: checkpoint-2 went once checkpoint-3 was durable; no pending directory is left.
        assert run["left"] == ["checkpoint-3"], (rank, run["left"])
    run = runs["strategy"][0]["lora_async"]
    assert run["different"] == [] and run["compared"] > 10, run  # adapter, trainer_state/, RNG, arguments


def test_unservable_settings_stop_every_rank_before_weights_load(tiny_model, tmp_path):
    result = launch("hf_trainer.py", ["--mode", "refuse", "--model", tiny_model, "--out", str(tmp_path)],
                    tmp_path, nnodes=2, nproc_per_node=2, timeout=120)
    ended = time.time()  # every rank and both torchrun agents are gone
    assert not result.timed_out and all(rc != 0 for rc in result.returncodes), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for rank, data in ranks.items():
        # accelerate's ZeRO-3 (its launcher's variables): refused by from_pretrained, before the process group
        assert data["env_error"].startswith("accelerate's DeepSpeed ZeRO-3 (ACCELERATE_USE_DEEPSPEED=true) cannot "
                                            "run with NativeFSDPStrategy: drop it from the accelerate config"), data
        assert "\n" not in data["env_error"] and data["env_refused_before_process_group"] is True
        # a ZeRO-3 config in TrainingArguments: refused by the trainer, before any weight moves
        assert data["error_type"] == "ConflictingShardingError", (rank, data.get("traceback"))
        assert "TrainingArguments.deepspeed" in data["error"] and "ZeRO-3" in data["error"], data["error"]
        assert "\n" not in data["error"]
        assert data["init_report_before"] is False  # no rank had received a weight
        # Before that, sequence_parallel_size=2 with a compute_loss_func: refused on every rank before wrapping.
        assert data["sp_refusal"] == ("sequence_parallel_size=2 with StrategyTrainer: compute_loss_func would receive "
                                      "a chunk's labels, already shifted on the whole row, and shift them again; drop "
                                      "compute_loss_func, or use sequence_parallel_size=1"), data["sp_refusal"]
        assert data["sp_init_report"] is False
    # Every rank refused on its own and the whole launch ended seconds later (no rank waits for another).
    refused = [data["refused_at"] for data in ranks.values()]
    assert max(refused) - min(refused) < REFUSAL_SPREAD_S and ended - min(refused) < REFUSAL_SPREAD_S, \
        (refused, ended)


def test_from_pretrained_refuses_accelerate_sharding_before_the_process_group_and_any_file(monkeypatch, tmp_path):
    from twinkle_strategy import NativeFSDPStrategy

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    with pytest.raises(ConflictingShardingError, match=r"^FSDP_CPU_RAM_EFFICIENT_LOADING=true \(accelerate's FSDP "
                                                       r"cpu_ram_efficient_loading.*: unset it"):
        NativeFSDPStrategy(ep_size=1, device_type="cpu").from_pretrained(str(tmp_path / "no-such-checkpoint"))
    assert not torch.distributed.is_initialized()


def test_accelerate_launch_with_deepspeed_or_fsdp_is_refused(tmp_path):
    config = tmp_path / "ds_zero3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConflictingShardingError, match=r"DeepSpeed ZeRO-3 \(ACCELERATE_USE_DEEPSPEED=true\)"):
        refuse_conflicting_sharding(environ={"ACCELERATE_USE_DEEPSPEED": "true",
                                             "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)})
    with pytest.raises(ConflictingShardingError, match="ACCELERATE_USE_FSDP=true"):
        refuse_conflicting_sharding(environ={"ACCELERATE_USE_FSDP": "true"})
    with pytest.raises(ConflictingShardingError, match="^FSDP_CPU_RAM_EFFICIENT_LOADING=true"):
        refuse_conflicting_sharding(environ={"FSDP_CPU_RAM_EFFICIENT_LOADING": "1"})
    # what `accelerate launch` sets without them, and TrainingArguments(fsdp_config=...) by default
    refuse_conflicting_sharding(environ={"ACCELERATE_USE_DEEPSPEED": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false"})


def test_training_arguments_fsdp_is_refused_as_the_user_wrote_it(tmp_path):
    """transformers keeps fsdp=True whatever was passed (a legacy string's options move into fsdp_config): the
    refusal names the string the user wrote, not "fsdp=True" (issue 35)."""
    from transformers import TrainingArguments

    def refusal(**fsdp) -> str:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fsdp)
        with pytest.raises(ConflictingShardingError) as caught:
            refuse_conflicting_sharding(args, environ={})
        return str(caught.value)

    assert refusal(fsdp="full_shard").startswith(
        "TrainingArguments(fsdp='full_shard', or fsdp=True with fsdp_config={'reshard_after_forward': True}) cannot "
        "run with NativeFSDPStrategy")
    assert refusal(fsdp="shard_grad_op offload auto_wrap").startswith(
        "TrainingArguments(fsdp='shard_grad_op offload', or fsdp=True with fsdp_config={'reshard_after_forward': "
        "False, 'cpu_offload': True}) cannot")
    assert refusal(fsdp=True).startswith("TrainingArguments(fsdp=True) cannot run with NativeFSDPStrategy")
    assert "drop fsdp= and fsdp_config=" in refusal(fsdp=True)


def test_a_model_transformers_sharded_at_load_is_refused(tiny_model):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.integrations.transformers import refuse_transformers_expert_parallel

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    refuse_transformers_expert_parallel(model)
    # What from_pretrained(distributed_config=DistributedConfig(enable_expert_parallel=True)) marks its models with.
    model._is_distributed_loading_by_transformers = True  # (behind the public is_distributed_loading_by_transformers)
    with pytest.raises(ConflictingShardingError, match=r"distributed_config=.*NativeFSDPStrategy.from_pretrained"):
        refuse_transformers_expert_parallel(model)


def test_sequence_parallel_refuses_each_setting_it_cannot_serve_by_name(tiny_model, tmp_path):
    """What the mixin checks before wrapping under sequence_parallel_size > 1, on real trainers (one process):
    each refusal names the setting and the fix; the default Trainer passes."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from twinkle_strategy.errors import ParallelConfigError
    from twinkle_strategy.integrations.transformers.sequence import refuse_unserved
    from twinkle_strategy.train.demo_model import prepare_demo_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    common = dict(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])

    def trainer(**args):
        return Trainer(model=model, args=TrainingArguments(**common, **args), train_dataset=[], eval_dataset=[])

    refuse_unserved(trainer(), 2)
    with pytest.raises(ParallelConfigError, match=r"^sequence_parallel_size=2 with Trainer: label_smoothing_factor=0.1 "
                                                  r"shifts a chunk's labels again; set it to 0"):
        refuse_unserved(trainer(label_smoothing_factor=0.1), 2)
    with pytest.raises(ParallelConfigError, match=r"evaluation is not split along the sequence yet; set "
                                                  r"eval_strategy='no'"):
        refuse_unserved(trainer(eval_strategy="steps", eval_steps=1), 2)
    plain = trainer()
    plain.model_accepts_loss_kwargs = False  # what HF finds for a forward without **kwargs
    with pytest.raises(ParallelConfigError, match=r"takes no num_items_in_batch, so each chunk's loss would be a mean"):
        refuse_unserved(plain, 2)
    # TRL adds the model's aux loss once per forward, on by default for an MoE config with router_aux_loss_coef.
    demo = prepare_demo_model(str(tmp_path / "demo"), str(REPO / "examples" / "data" / "demo_sft.jsonl"))
    sft = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(demo), processing_class=AutoTokenizer.from_pretrained(demo),
                     args=SFTConfig(**common, max_length=32, dataset_num_proc=None),
                     train_dataset=Dataset.from_list([{"text": "a b c d"}] * 2))
    assert sft.aux_loss_enabled
    with pytest.raises(ParallelConfigError, match=r"with SFTTrainer: TRL adds the router aux loss once per forward, so "
                                                  r"sp times per micro-batch here; pass router_aux_loss_coef=0"):
        refuse_unserved(sft, 2)
