"""No FutureWarning the package causes (issue 47: ``examples/grpo.py --demo`` printed 20 of transformers' "`...` is
deprecated" warnings on each rank).

transformers 5.2x renamed gradient checkpointing to activation checkpointing (``activation_checkpointing_enable``,
``is_activation_checkpointing``); the old names warn. The package calls the new ones, through
:mod:`twinkle_strategy.compat.transformers_internals.activation_checkpointing` where transformers 5.19 has only the
old. A warning is the package's when the innermost caller outside transformers (and ``warnings``) is a frame of
``twinkle_strategy``: those that remain in a run come from TRL 1.16 (its configs' default
``gradient_checkpointing=True``, ``unwrap_model_for_generation``, ``disable_gradient_checkpointing``) and peft 0.21
(``PeftModel.__init__``), which call transformers' old names themselves.

The path: ``with_strategy(GRPOTrainer)`` on the tiny demo MoE, one process (a world of one), LoRA on attention and
experts, TRL's default activation checkpointing on (the EP-replaying recompute wrapped in), routing replay R3, one
step: the package's trainer mixin, its generation, its replay and its checkpointing hooks all run.
"""

from __future__ import annotations

import os
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

import twinkle_strategy

PACKAGE = os.path.dirname(twinkle_strategy.__file__) + os.sep
TRANSFORMERS = os.path.dirname(transformers.__file__) + os.sep


def innermost_caller(stack: list[traceback.FrameSummary]) -> str:
    """The file that called into transformers last: the frames of ``warnings`` and transformers itself (where a
    deprecated name warns) are skipped from the innermost outwards, and so are attribute forwarders (peft's
    ``PeftModel.__getattr__`` hands a read of the base model's attribute on: the caller is who read it)."""
    for frame in reversed(stack):
        if (frame.filename.startswith(TRANSFORMERS) or frame.filename == warnings.__file__
                or frame.name in ("__getattr__", "__getattribute__")):
            continue
        return frame.filename
    return "<none>"


class FutureWarningCallers:
    """While open, every FutureWarning (each one, not once per place) with the file that made the call it warns of."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (message, caller file)
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> FutureWarningCallers:
        self._catch.__enter__()
        warnings.simplefilter("always", FutureWarning)

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, FutureWarning):  # called inside warn(): the stack is the caller's
                self.seen.append((str(message), innermost_caller(traceback.extract_stack()[:-1])))

        warnings.showwarning = show
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)

    def the_package_s(self) -> list[tuple[str, str]]:
        return [(message, caller) for message, caller in self.seen if caller.startswith(PACKAGE)]


@pytest.fixture(scope="module")
def strategy():
    from twinkle_strategy import NativeFSDPStrategy

    started = not dist.is_initialized()
    yield NativeFSDPStrategy(device_type="cpu", mixed_precision="no")
    if started and dist.is_initialized():
        dist.destroy_process_group()


def test_a_grpo_step_through_the_strategy_makes_no_future_warning_of_its_own(strategy, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from twinkle_strategy.integrations.transformers import with_strategy
    from twinkle_strategy.sources.demo import demo_conversations

    rows = [{"prompt": [row["messages"][0]]} for row in demo_conversations()[:8]]
    with FutureWarningCallers() as callers:
        model = strategy.from_pretrained("tiny://demo", dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(strategy.resolved_model_path("tiny://demo"))
        args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                          bf16=False, disable_tqdm=True, seed=0)
        assert args.gradient_checkpointing  # TRL's default: the package's checkpointing hooks run
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        trainer = with_strategy(GRPOTrainer)(
            model=model, args=args, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
            reward_funcs=lambda completions, **_: [float(len(str(c))) for c in completions], peft_config=lora,
            strategy=strategy, routing_replay="r3")
        trainer.train()
    assert trainer.state.global_step == 1
    assert callers.the_package_s() == [], callers.the_package_s()
