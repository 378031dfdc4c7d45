"""The memory plan against real runs: the per-rank peak of tensor memory in the step, and the init's.

One launch of 4 ranks (2 simulated nodes x 2 ranks, regrouped as 1 node x 4 where a configuration says
so) trains each configuration a few steps and records what every rank held (tests/workers/plan_vs_run.py,
counted by tests/workers/alloc_tracker.py, itself checked in tests/unit/test_alloc_tracker.py); this
process plans the same recipes and compares.
"""

import json

import pytest
from multinode import launch

from twinkle_strategy.planning import plan_memory
from twinkle_strategy.train.fit_check import request_from_recipe
from twinkle_strategy.train.recipe import load_recipe

TOLERANCE = 0.10
SCALARS = 1024  # bytes: a receiver's init peak is planned exactly but for a few scalar tensors
CONFIGS = {
    "lora_ep2": ["strategy.ep_size=2", "strategy.memory_efficient_init=true", "tuner.type=lora"],
    # One node of 4 ranks (the same 4 processes regrouped: tests/workers/plan_vs_run.py's node_shape).
    "full_ep4_1x4": ["strategy.ep_size=4", "tuner.type=full", "strategy.memory_efficient_init=true",
                     "launch.nnodes=1", "launch.nproc_per_node=4"],
    "gc_sp2_ep2": ["strategy.ep_size=2", "strategy.sequence_parallel_size=2", "train.gradient_checkpointing=true",
                   "tuner.type=lora", "strategy.memory_efficient_init=true"],
    # LoRA over the FP8 release of the same tiny model, its frozen weights kept as stored (model.path: below).
    "fp8_keep_ep2": ["strategy.ep_size=2", "tuner.type=lora", "strategy.memory_efficient_init=true",
                     "strategy.quantized_base=keep", "model.dtype=bfloat16"],
    # A sharded Qwen3-MoE of 217 MiB (hub layout, 5 safetensors files; model.path: below): the init streams real
    # shards through real buckets, and the step's FSDP2 buffers are megabytes, not the demo's kilobytes.
    # Its LoRA on attention and experts takes lora_experts' default (activations: W + BA never formed).
    "sharded_217m_lora_ep2": ["strategy.ep_size=2", "tuner.type=lora", "strategy.memory_efficient_init=true"],
    # The same with LoRA on attention alone: what LoRA on the experts costs, run against plan (issue 46).
    "sharded_217m_lora_attention_ep2": ["strategy.ep_size=2", "tuner.type=lora",
                                        "strategy.memory_efficient_init=true", "tuner.target_parameters=[]"],
    # The same with PEFT's own path, W + BA formed for every local expert (issue 46: the fall-back stays planned).
    "sharded_217m_lora_ep2_peft": ["strategy.ep_size=2", "tuner.type=lora", "strategy.memory_efficient_init=true",
                                   "strategy.lora_experts=peft"],
}
SHARDED = [name for name in CONFIGS if name.startswith("sharded_217m")]
SHARDED_SIZES = {"hidden_size": 512, "intermediate_size": 512, "num_layers": 8, "max_shard_size": "50MB"}


@pytest.fixture(scope="module")
def long_rows(tmp_path_factory):
    """Rows longer than max_length, cut to it (truncation_strategy right): every row is max_length tokens, as
    the plan assumes, so padding does not make the run smaller than its plan."""
    path = tmp_path_factory.mktemp("plan_data") / "long.jsonl"
    with open(path, "w") as f:
        for i in range(64):
            f.write(json.dumps({"query": f"What is {i} plus {i + 1}?",
                                "response": f"{i} plus {i + 1} is {2 * i + 1}. " * 12}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def runs(long_rows, tmp_path_factory):
    from twinkle_strategy.train.demo_model import prepare_demo_model

    work = tmp_path_factory.mktemp("plan_vs_run")
    model = prepare_demo_model(str(work / "demo"), long_rows)
    release = _fp8_release_with_tokenizer(work / "fp8", model)
    sharded = prepare_demo_model(str(work / "sharded"), long_rows, **SHARDED_SIZES)
    paths = {"fp8_keep_ep2": release, **{name: sharded for name in SHARDED}}
    configs = {name: keys + ([f"model.path={paths[name]}"] if name in paths else []) for name, keys in CONFIGS.items()}
    common = [f"model.path={model}", f"data.dataset=[{long_rows}]", "data.max_length=64",
              "data.truncation_strategy=right", "model.dtype=float32", "strategy.mixed_precision=no",
              "strategy.device_type=cpu", "train.per_device_train_batch_size=4", f"train.output_dir={work / 'out'}",
              "train.logging_steps=1", "train.save_only_model=true", "launch.nnodes=2", "launch.nproc_per_node=2",
              "tuner.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    args = ["--common", *common]
    for name, keys in configs.items():
        args += ["--config", f"{name}:{';'.join(keys)}"]
    result = launch("plan_vs_run.py", args, work / "launch", nnodes=2, nproc_per_node=2, timeout=900)
    assert result.ok(), result.describe()
    print("seconds per configuration (rank 0):", {name: round(r["seconds"], 1) for name, r in
                                                  result.rank_results()[0]["configs"].items()})
    plans = {name: plan_memory(request_from_recipe(load_recipe(None, common + keys))) for name, keys in configs.items()}
    return result.rank_results(), plans


def _fp8_release_with_tokenizer(path, demo: str) -> str:
    """The demo's sizes as an FP8-block release (DeepSeek-V3's layout), with the demo's tokenizer."""
    import shutil

    from twinkle_strategy.testing.releases import save_tiny_quantized_checkpoint

    vocab = json.loads(open(f"{demo}/config.json").read())["vocab_size"]
    save_tiny_quantized_checkpoint("qwen3_moe", str(path), vocab_size=vocab)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{demo}/{name}", path / name)
    return str(path)


def _close(planned: int, measured: int) -> bool:
    return abs(planned - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_plans_step_peak_is_within_10_percent_of_the_runs(runs, name):
    """The run's peak is its busiest rank's (the one that runs out first); routing on a tiny untrained router is
    not balanced, so the other ranks hold a little less, none more than 10% above the plan."""
    ranks, plans = runs
    plan = plans[name]
    measured = {rank: r["configs"][name]["step_peak"] for rank, r in ranks.items()}
    assert _close(plan.peak, max(measured.values())), (name, plan.peak, measured, plan.step)
    assert all(m <= plan.peak * (1 + TOLERANCE) for m in measured.values()), (name, plan.peak, measured)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_plans_init_is_within_10_percent_of_source_and_receiver(runs, name):
    ranks, plans = runs
    plan = plans[name]
    kinds = set()
    for rank, r in ranks.items():
        got = r["configs"][name]
        # The init report's exact count of the shards it filled (in the model's dtypes).
        assert got["init_shard_bytes"] == plan.states.params_as_values + plan.states.buffers, (name, rank, got)
        planned = plan.init.source_host if got["is_source"] else plan.init.receiver_host
        assert _close(planned, got["init_peak"]), (name, rank, planned, got, plan.init)
        if not got["is_source"]:  # its shards and its receive buffers: exact, but for a few scalar tensors
            assert abs(planned - got["init_peak"]) <= SCALARS, (name, rank, planned, got, plan.init)
        kinds.add(got["is_source"])
        assert got["nodes"] == [plan.request.nnodes, plan.request.nproc_per_node], (name, rank, got["nodes"])
    assert kinds == {True, False}  # both kinds of rank were compared



def test_lora_on_the_experts_costs_in_the_run_what_the_plan_says(runs):
    """LoRA also on the experts against LoRA on attention alone, on the 217 MiB model at ep=2: the busiest rank's
    step peak grows by the same ratio in the run as in the plan (within 3.5 points), and by at most 5% (issue 46:
    the rows received are sent again in the backward, not kept). PEFT's path, which forms W + BA, grows by more.
    Measured: 1.024 in the run, 0.999 planned (the run's busiest rank receives more than a balanced share);
    keeping the rows received instead made the run 1.052."""
    ranks, plans = runs

    def peak(name: str) -> int:
        return max(r["configs"][name]["step_peak"] for r in ranks.values())

    attention = "sharded_217m_lora_attention_ep2"
    measured = {name: peak(name) / peak(attention) for name in ("sharded_217m_lora_ep2", "sharded_217m_lora_ep2_peft")}
    planned = {name: plans[name].peak / plans[attention].peak for name in measured}
    ratios = (measured, planned)
    print("step peak over LoRA on attention alone (run, plan):", ratios)
    assert abs(measured["sharded_217m_lora_ep2"] - planned["sharded_217m_lora_ep2"]) <= 0.035, ratios
    assert measured["sharded_217m_lora_ep2"] <= 1.05 and planned["sharded_217m_lora_ep2"] <= 1.05, ratios
    assert measured["sharded_217m_lora_ep2_peft"] > measured["sharded_217m_lora_ep2"] + 0.2, ratios
