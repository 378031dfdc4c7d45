"""The suite's shared launches: one session fixture per launch shape, whose record several test files assert on.

Start-up (each rank imports torch and transformers) is most of a launch's cost on 2 cores, so cases that need the
same shape ride one launch: a test adds its case to a worker run here (a flag, a case name) rather than launching
again. conftest.py registers this module as a plugin; the launch table and budget are tests/launch_log.py's.

* :func:`refusals` - tests/workers/bad_config.py on 2 nodes x 2 ranks, every refusal case in turn, the last one left
  uncaught: the invalid sizes (test_foundation_multiproc.py), the broken checkpoints (test_reliability.py) and the
  broken hub checkpoints (test_memory_efficient_init.py).
* :func:`demo_model` - tiny://demo's model with the tokenizer of the shipped demo data, built once per pytest run.
* :func:`swift_style_relaunch` - twinkle-sft with swift's flags and NPROC_PER_NODE=2 (its torchrun re-launch, one
  node x 2 ranks) on 20 rows of which 3 are bad: the re-launch (test_trainer_cli.py) and the bad rows skipped
  (test_launch_errors.py).
* :func:`doc_pages` - the python blocks of docs/transformers.md, docs/rl.md and docs/strategy.md, each page as one
  script, under their shared single-machine torchrun command (1 node x 2 ranks): test_docs_transformers.py and
  test_docs_rl.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_cases import twenty_rows_three_bad
from doc_pages import PagesRun, run_pages
from header_edit import EDITS, corrupt_copy
from multinode import REPO, LaunchResult, launch
from parallel_workers import once_per_run

DATASET = str(REPO / "examples" / "data" / "demo_sft.jsonl")
DOC_PAGES = ["docs/transformers.md", "docs/rl.md", "docs/strategy.md"]  # pages whose python blocks run as written


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """tiny://demo's model and the tokenizer of examples/data/demo_sft.jsonl, built once per pytest run."""
    from twinkle_strategy.train.demo_model import prepare_demo_model

    return once_per_run(tmp_path_factory, "demo_model",
                        lambda: prepare_demo_model(str(tmp_path_factory.mktemp("demo") / "model"), DATASET))


# ------------------------------------------------------------------ twinkle-sft re-launched as swift launches
@dataclasses.dataclass(frozen=True)
class CliRun:
    proc: subprocess.CompletedProcess
    output_dir: Path
    dataset: str  # the 20 rows of cli_cases.twenty_rows_three_bad: rows 4, 9 and 15 cannot become an example


@pytest.fixture(scope="session")
def swift_style_relaunch(demo_model, tmp_path_factory) -> CliRun:
    """``NPROC_PER_NODE=2 twinkle-sft --model ... --dataset ...`` with swift's flags and no recipe: twinkle-sft
    re-launches itself under torchrun (one node, 2 ranks, ep=2, LoRA, memory-efficient init) and trains one epoch
    (max_steps -1) of the 17 good rows of 20, 2 per rank: 4 steps."""
    return once_per_run(tmp_path_factory, "swift_style_relaunch", lambda: _swift_style_relaunch(demo_model,
                                                                                                tmp_path_factory))


def _swift_style_relaunch(demo_model: str, tmp_path_factory) -> CliRun:
    work = tmp_path_factory.mktemp("swift_style")
    dataset = twenty_rows_three_bad(work / "bad20.jsonl")
    out = work / "out"
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "NPROC_PER_NODE": "2"}  # no MASTER_PORT: twinkle-sft picks one
    proc = subprocess.run([sys.executable, "-m", "twinkle_strategy.train.cli", "--model", demo_model,
                           "--dataset", dataset, "--tuner_type", "lora", "--target_modules", "q_proj",
                           "--expert_parallel_size", "2", "--memory_efficient_init", "true", "--torch_dtype", "float32",
                           "--mixed_precision", "no", "--max_length", "64", "--max_steps", "-1",
                           "--num_train_epochs", "1", "--logging_steps", "1", "--per_device_train_batch_size", "2",
                           "--output_dir", str(out)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    return CliRun(proc, out, dataset)


# ------------------------------------------------------------------ the refusals launch (bad_config.py, 2 x 2)
@pytest.fixture(scope="session")
def broken_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    """The tiny Qwen3-MoE checkpoint broken one way each: a missing key, a truncated file, each header safetensors
    rejects, an invalid config.json (and "good", the unbroken one)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("broken")
    good = tiny_checkpoints / "qwen3_moe"
    paths = {}
    for name in ("missing_key", "corrupt"):
        shutil.copytree(good, root / name)
        paths[name] = root / name
    weights = load_file(str(good / "model.safetensors"))
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, str(paths["missing_key"] / "model.safetensors"), metadata={"format": "pt"})
    data = (good / "model.safetensors").read_bytes()
    (paths["corrupt"] / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated file
    for edit in EDITS:  # headers safetensors itself rejects
        paths[edit] = root / edit
        shutil.copytree(good, paths[edit])
        corrupt_copy(good / "model.safetensors", paths[edit] / "model.safetensors", edit)
    paths["invalid_config_json"] = root / "invalid_config_json"
    shutil.copytree(good, paths["invalid_config_json"])
    (paths["invalid_config_json"] / "config.json").write_text('{"model_type": "qwen3_moe",, }')
    return {k: str(v) for k, v in paths.items()} | {"good": str(good)}


HUB_WRONG_KEY = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
HUB_MISSING_KEY = "model.layers.0.block_sparse_moe.experts.5.w1.weight"
HUB_TRUNCATED_KEY = "model.layers.1.block_sparse_moe.experts.6.w3.weight"


@pytest.fixture(scope="session")
def broken_hub_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """The sharded Mixtral checkpoint (per-expert hub keys) with one fault each."""
    import torch
    from safetensors.torch import load_file, save_file

    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

    good = tiny_checkpoints / "mixtral_sharded"
    index = json.loads((good / "model.safetensors.index.json").read_text())["weight_map"]
    root = tmp_path_factory.mktemp("broken_hub")

    def variant(name, key, change):
        path = root / name
        shutil.copytree(good, path)
        weights = load_file(str(path / index[key]))
        change(weights)
        save_file(weights, str(path / index[key]), metadata={"format": "pt"})
        return path

    wrong = variant("wrong_shape", HUB_WRONG_KEY, lambda w: w.__setitem__(HUB_WRONG_KEY, torch.zeros(64, 16)))
    missing = variant("missing_key", HUB_MISSING_KEY, lambda w: w.pop(HUB_MISSING_KEY))
    weight_map = json.loads((missing / "model.safetensors.index.json").read_text())
    del weight_map["weight_map"][HUB_MISSING_KEY]
    (missing / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    truncated = root / "truncated"
    shutil.copytree(good, truncated)
    stored = SafetensorsIndex.from_directory(str(good)).tensors[HUB_TRUNCATED_KEY]
    shard = truncated / index[HUB_TRUNCATED_KEY]
    shard.write_bytes(shard.read_bytes()[:stored.begin + stored.nbytes // 2])  # cut inside that tensor
    return {"wrong_shape": wrong, "missing_key": missing, "truncated": truncated}


@pytest.fixture(scope="session")
def odd_checkpoints(tmp_path_factory) -> tuple[str, str]:
    """A Qwen3-MoE with 6 experts (not divisible by ep 4) and a dense Qwen3 (no MoE block for ep 2)."""
    import transformers as tf

    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("odd")
    six = save_tiny_checkpoint("qwen3_moe", str(root / "six_experts"), num_experts=6)
    dense_cfg = tf.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    tf.AutoModelForCausalLM.from_config(dense_cfg).save_pretrained(str(root / "dense"))
    return six, str(root / "dense")


# Every case runs in turn with its error recorded; the fatal one, last, then ends every rank with its error.
CHECKPOINT_CASES = ["missing_key", "wrong_shape", "corrupt_file", "missing_path", "dtype_differs_on_node1",
                    *EDITS, "invalid_config_json", "output_dir_not_shared"]
HUB_CASES = ["hub_wrong_shape", "hub_missing_key", "hub_truncated"]
SIZE_CASES = ["ep_not_dividing_world", "ep_fsdp_mismatch", "experts_not_divisible", "dense_model_with_ep"]
FATAL_CASE = "ep_not_dividing_world"


@dataclasses.dataclass(frozen=True)
class RefusalRun:
    result: LaunchResult
    headers: dict[str, str]  # case -> the checkpoint with that broken header (or config.json)
    node_dirs: list[Path]  # each simulated node's own output directory (output_dir_not_shared)


@pytest.fixture(scope="session")
def refusals(broken_checkpoints, wrong_shape_checkpoint, broken_hub_checkpoints, odd_checkpoints,
             tmp_path_factory) -> RefusalRun:
    """bad_config.py on 2 nodes x 2 ranks: every refusal case in turn, then FATAL_CASE uncaught."""
    return once_per_run(tmp_path_factory, "refusals", lambda: _refusals(
        broken_checkpoints, wrong_shape_checkpoint, broken_hub_checkpoints, odd_checkpoints, tmp_path_factory))


def _refusals(broken_checkpoints, wrong_shape_checkpoint, broken_hub_checkpoints, odd_checkpoints,
              tmp_path_factory) -> RefusalRun:
    out = tmp_path_factory.mktemp("refusals")
    headers = {case: broken_checkpoints[case] for case in [*EDITS, "invalid_config_json"]}
    six, dense = odd_checkpoints
    # Each simulated node gets its own output directory, as nodes with only local disks would.
    node_dirs = [out / f"node{n}_disk" / "output" for n in range(2)]
    hub = broken_hub_checkpoints
    result = launch("bad_config.py", ["--cases", ",".join([*CHECKPOINT_CASES, *HUB_CASES, *SIZE_CASES]),
                                      "--fatal", FATAL_CASE,
                                      "--missing-key", broken_checkpoints["missing_key"],
                                      "--wrong-shape", str(wrong_shape_checkpoint),
                                      "--corrupt", broken_checkpoints["corrupt"], "--good", broken_checkpoints["good"],
                                      "--checkpoints", json.dumps(headers),
                                      "--hub-wrong-shape", str(hub["wrong_shape"]),
                                      "--hub-missing-key", str(hub["missing_key"]),
                                      "--hub-truncated", str(hub["truncated"]),
                                      "--six-experts", six, "--dense", dense],
                    out, nnodes=2, nproc_per_node=2, timeout=600,
                    node_env=[{"TWINKLE_TEST_NODE_DIR": str(d)} for d in node_dirs])
    return RefusalRun(result, headers, node_dirs)


def assert_every_rank_reached_the_fatal_case(run: RefusalRun) -> dict[int, dict]:
    """No rank hung or died in a case: every one recorded every case, then ended with the fatal case's error."""
    result = run.result
    assert not result.timed_out, result.describe()
    assert all(rc not in (0, None) for rc in result.returncodes), result.describe()
    ranks = result.rank_results()
    assert sorted(ranks) == [0, 1, 2, 3], result.describe()
    for rank, data in ranks.items():
        assert data["ok"] is False and data["error_type"] == "ParallelConfigError", (rank, data.get("error"))
        assert set(data["errors"]) == {*CHECKPOINT_CASES, *HUB_CASES, *SIZE_CASES}, (rank, sorted(data["errors"]))
    return ranks


# ------------------------------------------------------------------ the faults no process dies of (faults.py, 2 x 2)
# tests/workers/faults.py --batch: each scenario's error recorded in turn; the last one's ends every rank.
FAULT_BATCH = ["fail_trainer_state_writes", "disk_full_during_save:lora", "disk_full_during_save:full",
               "corrupt_in_transit"]
FAULT_LIMIT = 600  # seconds for the four: a hang fails the tests instead of blocking CI


@dataclasses.dataclass(frozen=True)
class FaultRun:
    result: LaunchResult
    output_dir: Path  # each scenario writes under output_dir / KEY (the entry with ':' as '_')


@pytest.fixture(scope="session")
def fault_batch(demo_model, tmp_path_factory) -> FaultRun:
    """faults.py on 2 nodes x 2 ranks: the faults no process dies of, one after another (test_reliability.py)."""
    return once_per_run(tmp_path_factory, "fault_batch", lambda: _fault_batch(demo_model, tmp_path_factory))


def _fault_batch(demo_model: str, tmp_path_factory) -> FaultRun:
    root = tmp_path_factory.mktemp("faults")
    result = launch("faults.py", ["--batch", ",".join(FAULT_BATCH), "--model", demo_model, "--dataset", DATASET,
                                  "--output-dir", str(root / "out")], root / "logs", timeout=FAULT_LIMIT)
    return FaultRun(result, root / "out")


# ------------------------------------------------------------------ the doc pages' blocks (1 node x 2 ranks)
@pytest.fixture(scope="session")
def doc_pages(tmp_path_factory) -> PagesRun:
    """One launch runs every page of DOC_PAGES as written: the pages share their torchrun command's options (each
    names its own script), so they ride one launch instead of one each."""
    return once_per_run(tmp_path_factory, "doc_pages", lambda: run_pages(DOC_PAGES, tmp_path_factory.mktemp("docs")))
