"""Bad input is one of the package's error classes, so that it is one line per rank under torchrun (issue 47:
``routing_replay="R3x"`` raised a plain ValueError, a 66-line traceback on each rank), and each still is the builtin
it replaced (``except ValueError`` / ``TypeError`` / ``RuntimeError`` in a user's code keeps working). A misspelt
keyword names the closest one. How the lines look on real terminals: tests/multiproc/test_fatal_errors.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import twinkle_strategy
from twinkle_strategy import NativeFSDPStrategy
from twinkle_strategy.errors import (
    ArgumentError,
    ArgumentTypeError,
    CallOrderError,
    StrategyConfigError,
    TwinkleError,
    UnknownKeywordError,
    did_you_mean,
)

PACKAGE = Path(twinkle_strategy.__file__).parent
BUILTINS = ("ValueError", "TypeError", "KeyError", "RuntimeError")
# The builtin raises left, by (module, function): none is the user's input. Each says why.
NOT_BAD_INPUT = {
    # An invariant of the package's own code (a bug if raised), not something a user passes.
    ("checkpoint/layout.py", "checkpoint_pieces"), ("checkpoint/save_plan.py", "execute_save"),
    ("checkpoint/writing.py", "write"), ("init/streams.py", "as_bytes_view"), ("moe/expert_axis.py", "_split_shape"),
    ("moe/expert_axis.py", "row_runs"),
    # A recomputation that routed otherwise than its forward: nondeterminism, not input.
    ("moe/dispatch.py", "_recorded_exchange"), ("moe/recompute.py", "next"),
    # A rollout engine that failed or refused, or a receiver driven out of order by the package's own export (which
    # reports it as a WeightSyncError, one of ours, on every rank).
    ("rl/engines/sglang.py", "_check"), ("rl/engines/sglang_distributed.py", "__call__"),
    ("rl/engines/sglang_distributed.py", "prepare"), ("rl/engines/trl_client.py", "__call__"),
    ("rl/engines/trl_client.py", "finish"), ("rl/receivers.py", "__call__"), ("rl/vllm_receiver.py", "__call__"),
    ("rl/vllm_receiver.py", "finish"), ("rl/vllm_routing.py", "capture_routing"),
    ("rl/vllm_routing.py", "generate_with_routing"),
    # twinkle-sft's TrainingArguments checks: load_recipe makes each a RecipeError naming the recipe key.
    ("train/arguments.py", "__post_init__"),
}


def builtin_raises() -> set[tuple[str, str]]:
    """(module, enclosing function) of every ``raise ValueError(...)`` (or TypeError, KeyError, RuntimeError)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and isinstance(node.exc.func, ast.Name) and node.exc.func.id in BUILTINS):
                    found.add((str(path.relative_to(PACKAGE)), function.name))
    return found


def test_bad_input_raises_one_of_the_package_s_classes():
    """A new ``raise ValueError`` for bad input would be a traceback per rank again: use a class of errors.py (or
    say here why it is no bad input)."""
    assert builtin_raises() <= NOT_BAD_INPUT, sorted(builtin_raises() - NOT_BAD_INPUT)


def test_each_class_is_still_the_builtin_it_replaced():
    assert issubclass(ArgumentError, ValueError) and issubclass(StrategyConfigError, ValueError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(UnknownKeywordError, TypeError)
    assert issubclass(CallOrderError, RuntimeError)
    assert all(issubclass(cls, TwinkleError) for cls in (ArgumentError, ArgumentTypeError, UnknownKeywordError,
                                                         CallOrderError))


def test_a_misspelt_strategy_option_names_the_closest():
    with pytest.raises(UnknownKeywordError, match=r"^NativeFSDPStrategy has no option ep_sise=; did you mean "
                                                  r"ep_size\?$"):
        NativeFSDPStrategy(ep_sise=2)
    with pytest.raises(UnknownKeywordError, match=r"has no option zzz=; the options are ep_size, ep_fsdp_size, "):
        NativeFSDPStrategy(zzz=2)
    from twinkle_strategy.config import StrategyConfig

    with pytest.raises(UnknownKeywordError, match="did you mean mixed_precision"):
        StrategyConfig().replace(mixed_precison="bf16")


def test_a_misspelt_trainer_keyword_names_the_closest():
    """Python's own TypeError for it, 70 lines per rank under torchrun, becomes one line naming the closest keyword,
    the strategy's (routing_replay, async_save) and the trainer's own alike."""
    from transformers import Trainer
    from trl import GRPOTrainer

    from twinkle_strategy.integrations.transformers import with_strategy

    # (The trainer's CPU set-up starts the strategy's world of one before the trainer class reads its keywords:
    # it is ended here, so that later tests in this process start without a process group.)
    strategy = NativeFSDPStrategy(device_type="cpu")
    try:
        with pytest.raises(UnknownKeywordError, match=r"^StrategyGRPOTrainer takes no keyword argument "
                                                      r"routing_reply=; did you mean routing_replay\?$"):
            with_strategy(GRPOTrainer)(model=None, strategy=strategy, routing_reply="r3")
        with pytest.raises(UnknownKeywordError, match=r"^StrategyTrainer takes no keyword argument data_colator=; "
                                                      r"did you mean data_collator\?$"):
            with_strategy(Trainer)(model=None, strategy=strategy, data_colator=None)
        with pytest.raises(UnknownKeywordError, match=r"takes no keyword argument zzzz=; it takes args, async_save, "):
            with_strategy(Trainer)(model=None, strategy=strategy, zzzz=1)
    finally:
        strategy.shutdown()


def test_a_routing_replay_mode_it_does_not_have_is_a_strategy_config_error():
    from trl import GRPOTrainer

    from twinkle_strategy.integrations.transformers import with_strategy

    with pytest.raises(StrategyConfigError, match=r"^routing_replay is one of \('auto', 'r3', 'r2', 'off'\), not "
                                                  r"'R3x'$") as raised:
        with_strategy(GRPOTrainer)(model=None, strategy=NativeFSDPStrategy(device_type="cpu"), routing_replay="R3x")
    assert raised.value.key == "routing_replay"


def test_did_you_mean_is_the_flags_hint_too():
    assert did_you_mean("learning-rate".replace("-", "_"), ["learning_rate", "lr_scheduler_type"],
                        prefix="--") == "did you mean --learning_rate?"
    assert did_you_mean("qqq", ["learning_rate"]) == ""
