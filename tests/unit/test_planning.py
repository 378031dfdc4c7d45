"""twinkle-sft plan / NativeFSDPStrategy.plan: the memory plan, in one process (no launch)."""

import dataclasses
import json

import pytest
from multinode import REPO

from twinkle_strategy import NativeFSDPStrategy
from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.planning import PlanInputError, PlanRequest, plan_memory, to_json
from twinkle_strategy.planning.skeleton import build_planned_model
from twinkle_strategy.planning.states import ADAMW_STATES, STEP_BYTES, model_states

CONFIGS = REPO / "twinkle_strategy" / "planning" / "configs"


@pytest.fixture(scope="module")
def demo_config(tmp_path_factory):
    from twinkle_strategy.train.demo_model import TinySizes, qwen3_moe_config

    path = tmp_path_factory.mktemp("demo_config")
    qwen3_moe_config(TinySizes()).save_pretrained(path)
    return str(path)


def _request(path, **changes):
    base = dict(model_path=path, strategy=StrategyConfig(ep_size=2, mixed_precision="no"), nproc_per_node=4,
                dtype="float32", micro_batch=4, max_length=64)
    return PlanRequest(**{**base, **changes})


def test_model_states_are_the_shards_the_run_keeps(demo_config):
    """Full fine-tuning in one process: every parameter whole, AdamW's two states and a step counter each."""
    request = _request(demo_config, nproc_per_node=1, strategy=StrategyConfig(mixed_precision="no"), lora=None)
    states = model_states(build_planned_model(request), request)
    assert states.params == states.total_params * 4 == states.trainable_params == states.grads
    assert states.optimizer == ADAMW_STATES * states.params + STEP_BYTES * states.trainable_count
    # 4 ranks, ep 2: experts split over 2 EP ranks and sharded over the other 2, the rest over 4; padding only
    # where rows do not divide (none here), so every rank holds a quarter.
    sharded = model_states(build_planned_model(_request(demo_config, lora=None)), _request(demo_config, lora=None))
    assert sharded.params == states.params // 4


def test_lora_trains_only_the_adapters(demo_config):
    request = _request(demo_config)
    states = model_states(build_planned_model(request), request)
    assert 0 < states.trainable_params < states.params
    assert states.grads == states.trainable_params


def test_activations_grow_with_tokens_and_shrink_with_checkpointing(demo_config):
    plain = plan_memory(_request(demo_config))
    longer = plan_memory(_request(demo_config, max_length=128))
    checkpointed = plan_memory(_request(demo_config, gradient_checkpointing=True))
    assert longer.activations.total > 1.5 * plain.activations.total
    assert checkpointed.activations.total < plain.activations.total
    assert plain.step.total == max(sum(plain.step.parts().values()), plain.step.optimizer_step)


def test_a_plan_that_does_not_fit_ranks_its_fixes(demo_config):
    fits = plan_memory(_request(demo_config))
    tight = plan_memory(_request(demo_config, device_memory=int(fits.peak * 0.8)))
    assert tight.fits is False and tight.fixes
    assert tight.fixes[0].fits and tight.fixes[0].peak <= tight.request.device_memory
    fitting = [f.peak for f in tight.fixes if f.fits]
    assert fitting == sorted(fitting)
    record = json.loads(json.dumps(to_json(tight)))
    assert record["fits"] is False and record["step_peak_bytes"] == tight.peak
    assert record["verdict"].startswith("does not fit") and tight.fixes[0].change in record["verdict"]


def test_strategy_plan_is_the_same_plan(demo_config):
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no")
    plan = strategy.plan(demo_config, nproc_per_node=4, dtype="float32", micro_batch=4, max_length=64,
                         device_memory="1GiB")
    assert plan.fits and plan.peak == plan_memory(_request(demo_config)).peak


def test_a_world_the_sizes_do_not_divide_gets_the_launch_message(demo_config):
    with pytest.raises(ParallelConfigError, match="world size 6 is not divisible by ep_size 4"):
        plan_memory(_request(demo_config, nproc_per_node=6, strategy=StrategyConfig(ep_size=4)))
    with pytest.raises(ParallelConfigError, match="8 experts, not divisible by ep_size 3"):
        plan_memory(_request(demo_config, nproc_per_node=3, strategy=StrategyConfig(ep_size=3)))


def test_a_layers_backward_holds_the_gathered_layers_with_the_activations(demo_config):
    """Without checkpointing, a layer's backward holds two layers unsharded while nearly every activation is
    alive (a few hundred MB model: 32 MB the plan missed). The trace holds them from the layer's output
    gradient to its input's: given more than the activations, the peak moves there and takes them whole."""
    from twinkle_strategy.planning.activations import measure_activations

    request = _request(demo_config)
    plain = measure_activations(build_planned_model(request), request)
    held = 10 * plain.total
    holding = measure_activations(build_planned_model(request), request, gathered_in_backward=held)
    assert plain.total + held - plain.base <= holding.total <= plain.total + held, (plain, holding)
    assert holding.per_layer == plain.per_layer  # held once, whatever the layers: per-layer bytes unchanged


def test_the_step_peak_is_the_traces_with_one_layer_without_checkpointing_and_three_layers_with_it(tmp_path):
    """The sizes of tests/multiproc/test_plan_vs_run.py's sharded case (217 MiB, 16 MB layers). Without activation
    checkpointing the run's peak (counted with FSDP2's resized storages) is the last layer's forward: the plain
    trace plus the root and that layer gathered (the root alone put the plan 16% under the run with LoRA on
    attention and experts); holding two gathered layers in the trace's backward put the plan 11% over.
    With it, a layer's backward holds the root, two layers and one layer's flat all-gather output (its copy-out)."""
    from transformers import Qwen3MoeConfig

    from twinkle_strategy.planning.activations import measure_activations
    from twinkle_strategy.planning.plan import FLAT_ALL_GATHER_OUTPUTS, GATHERED_LAYERS

    Qwen3MoeConfig(vocab_size=384, hidden_size=512, intermediate_size=1024, moe_intermediate_size=512,
                   num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                   num_experts=8, num_experts_per_tok=2).save_pretrained(tmp_path)
    request = _request(str(tmp_path))
    states = model_states(build_planned_model(request), request)
    plain = measure_activations(build_planned_model(request), request)
    plan = plan_memory(request)
    assert plan.step.activations == plain.total, plan.step
    assert plan.step.gathered == states.root.unsharded + states.largest_layer, plan.step
    checkpointed = plan_memory(dataclasses.replace(request, gradient_checkpointing=True))
    layers = GATHERED_LAYERS + FLAT_ALL_GATHER_OUTPUTS
    assert checkpointed.step.gathered == states.root.unsharded + layers * states.largest_layer == \
        states.root.unsharded + 3 * states.largest_layer, checkpointed.step


def test_a_dense_config_is_planned_as_dense(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path)
    plan = plan_memory(_request(str(tmp_path), strategy=StrategyConfig(), nproc_per_node=2))
    assert any("no MoE layer" in note and "dense" in note for note in plan.notes), plan.notes
    assert plan.comm.all_to_all == 0 and plan.activations.total > 0


def test_a_missing_config_is_one_line_naming_the_path(tmp_path):
    with pytest.raises(PlanInputError) as info:
        plan_memory(_request(str(tmp_path / "nowhere")))
    assert str(tmp_path / "nowhere" / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_the_fixes_speak_the_python_api_and_each_front_end_spells_them(demo_config):
    """Issue 36: the library names its own arguments (micro_batch, ep_size); twinkle-sft spells them as recipe
    keys and the swift plugin as swift's flags and variables."""
    from twinkle_strategy.integrations.swift.parts.fit import swift_spelling
    from twinkle_strategy.planning import table, verdict_line
    from twinkle_strategy.train.fit_check import recipe_spelling

    fits = plan_memory(_request(demo_config))
    tight = plan_memory(_request(demo_config, device_memory=int(fits.peak * 0.8)))
    by_option = {fix.option: fix for fix in tight.fixes}
    smaller = by_option["micro_batch"]
    assert smaller.value == 2 and smaller.change == "micro_batch=2 (double the gradient accumulation)"
    assert "per_device_train_batch_size" not in table(tight) + json.dumps(to_json(tight))
    assert smaller.spelled(recipe_spelling) == "train.per_device_train_batch_size=2 (double the gradient accumulation)"
    assert smaller.spelled(swift_spelling) == "--per_device_train_batch_size 2 (double the gradient accumulation)"
    assert by_option["ep_size"].spelled(recipe_spelling) == "strategy.ep_size=4"
    assert by_option["ep_size"].spelled(swift_spelling) == "TWINKLE_EP_SIZE=4"
    assert by_option["gradient_checkpointing"].spelled(recipe_spelling) == "train.gradient_checkpointing=true"
    assert by_option["nnodes"].spelled(swift_spelling) == "NNODES=2"
    first = next(f for f in tight.fixes if f.fits)
    assert first.spelled(recipe_spelling) in table(tight, spelling=recipe_spelling)
    assert first.spelled(swift_spelling) in verdict_line(tight, spelling=swift_spelling)
    assert to_json(tight, spelling=recipe_spelling)["fixes"][0]["change"] == tight.fixes[0].spelled(recipe_spelling)


def test_twinkle_sft_plan_speaks_the_users_spelling(demo_config, capsys, monkeypatch):
    """Issue 47: a user who typed flags reads the fixes as flags (``--nnodes 2``), one who set recipe keys reads
    keys (``launch.nnodes=2``); an option the user did not set reads as the command line's own kind of words."""
    from twinkle_strategy.train.fit_check import UserSpelling, plan_command
    from twinkle_strategy.train.flags import parse

    monkeypatch.delenv("NNODES", raising=False)
    dataset = str(REPO / "examples" / "data" / "demo_sft.jsonl")

    def fixes(argv):
        assert plan_command([*argv, "--json"], parse) == 1  # 1 MiB fits nothing; every fix is listed
        return {f["option"]: f["change"] for f in json.loads(capsys.readouterr().out)["fixes"]}

    typed = ["--model", demo_config, "--dataset", dataset, "--nnodes", "1", "--nproc_per_node", "4",
             "--per_device_train_batch_size", "4", "--expert_parallel_size", "2"]
    flags = fixes([*typed, "--device_memory", "1MiB"])
    assert flags["nnodes"] == "--nnodes 2" and flags["ep_size"] == "--expert_parallel_size 4", flags
    assert flags["micro_batch"] == "--per_device_train_batch_size 2 (double the gradient accumulation)", flags
    assert flags["gradient_checkpointing"] == "--gradient_checkpointing true", flags  # not typed: a flag still
    keys = fixes([f"model.path={demo_config}", f"data.dataset=[{dataset}]", "launch.nnodes=1", "launch.nproc_per_node=4",
                  "launch.device_memory=1MiB", "train.per_device_train_batch_size=4", "strategy.ep_size=2"])
    assert keys["nnodes"] == "launch.nnodes=2" and keys["ep_size"] == "strategy.ep_size=4", keys
    assert keys["gradient_checkpointing"] == "train.gradient_checkpointing=true", keys
    # A mix: each option as the user set it; one not set, as a key (the line has key=value words)
    mixed = fixes(["--model", demo_config, "--dataset", dataset, "launch.nnodes=1", "--nproc_per_node", "4", "--device_memory", "1MiB",
                   "--per_device_train_batch_size", "4", "strategy.ep_size=2"])  # the same plan: cached
    assert mixed["nnodes"] == "launch.nnodes=2" and mixed["micro_batch"].startswith("--per_device_train_batch_size 2")
    assert mixed["gradient_checkpointing"] == "train.gradient_checkpointing=true", mixed
    # The refusal before a launch speaks the same words (cli.py passes the same spelling; a budget one byte short
    # of the peak: some fix fits)
    from twinkle_strategy.train.fit_check import check_fit_before_launch
    from twinkle_strategy.train.log_lines import PLANNED_PEAK_ENV

    monkeypatch.setenv(PLANNED_PEAK_ENV, "0")  # the check sets it (for a launch's workers); restored after the test
    assert plan_command([*typed, "--json"], parse) == 0
    argv = [*typed, "--device_memory", str(json.loads(capsys.readouterr().out)["step_peak_bytes"] - 1)]
    refusal = check_fit_before_launch(parse(argv), spelling=UserSpelling.of_argv(argv))
    assert "first fix: --" in refusal, refusal
    # Set in the environment (NNODES=1 twinkle-sft ...), where the run reads it first: that variable
    monkeypatch.setenv("NNODES", "1")
    assert UserSpelling.of_argv(["--nnodes", "1"])("nnodes", 2) == "NNODES=2"


def test_the_plans_assumptions_are_wrapped(demo_config):
    """Issue 47: the assumptions read as a list of lines of at most 100 columns, every word kept."""
    from twinkle_strategy.planning import PlanCache, table
    plan = plan_memory(_request(demo_config), cache=PlanCache.default())  # traced once
    lines = table(plan).splitlines()
    start = lines.index("assumptions:")
    part = lines[start + 1:-1]  # up to the verdict line
    assert len(part) > len(plan.assumptions) and all(len(line) <= 100 for line in part), part
    assert " ".join(" ".join(part).split()) == " ".join(f"- {a}" for a in plan.assumptions)
