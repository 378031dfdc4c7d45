"""Running a recipe in one training process: model, adapters, data, Trainer."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch

from twinkle_strategy.dtypes import float_dtype
from twinkle_strategy.sources.model_ids import TINY_PREFIX
from twinkle_strategy.strategy import NativeFSDPStrategy
from twinkle_strategy.train.data import DataCollatorForSFT, DatasetSpec, SFTDataset
from twinkle_strategy.train.demo_model import prepare_demo_model
from twinkle_strategy.train.packing import BatchLayout, DataCollatorForPacking, describe_layout
from twinkle_strategy.train.recipe import Recipe, TunerType, command_line_hubs
from twinkle_strategy.train.start_time import StartClock
from twinkle_strategy.train.trainer import Trainer

logger = logging.getLogger(__name__)

def prepare_model_path(path: str, datasets: list[str]) -> str:
    """``tiny://NAME`` builds the embedded tiny MoE (tokenizer trained on ``datasets``) under ./output/tiny/NAME."""
    if not path.startswith(TINY_PREFIX):
        return path
    name = path[len(TINY_PREFIX):] or "demo"
    target = os.path.abspath(os.path.join("output", "tiny", name))
    prepare_demo_model(target, [DatasetSpec.parse(d).path for d in datasets])
    return target


def lora_config(recipe: Recipe):
    from peft import LoraConfig

    modules = list(recipe.tuner.target_modules)
    return LoraConfig(
        r=recipe.tuner.lora_rank,
        lora_alpha=recipe.tuner.lora_alpha,
        lora_dropout=recipe.tuner.lora_dropout,
        use_dora=recipe.tuner.use_dora,
        lora_bias=recipe.tuner.lora_bias,
        target_modules="all-linear" if modules == ["all-linear"] else modules,
        target_parameters=list(recipe.tuner.target_parameters) or None,
    )


def data_collator(recipe: Recipe, tokenizer, dataset: SFTDataset, *, log: bool):
    """Padded rows, or one flattened row per micro-batch under data.packing / data.padding_free (said in the log)."""
    layout = BatchLayout.of(packing=recipe.data.packing, padding_free=recipe.data.padding_free)
    if not layout.flattened:
        return DataCollatorForSFT(tokenizer.pad_token_id)
    if log:
        logger.info(describe_layout(layout, dataset.examples, max_length=recipe.data.max_length))
    return DataCollatorForPacking()


def build_training(recipe: Recipe, run_dir: str | None = None, *, print_summary: bool = True,
                   start_clock: StartClock | None = None):
    """(trainer, strategy) for ``recipe``; used by the CLI and by tests that want the same run in Python.

    ``run_dir``: the run directory the launcher chose (default: a new ``v{N}-{time}`` under train.output_dir).
    ``print_summary``: the trainer prints the run directory and last checkpoint at the end.
    ``start_clock``: times the start (the data apart from the rest); the trainer tells it after the first step.
    """
    from transformers import AutoTokenizer

    timing_data = start_clock.loading_data if start_clock is not None else contextlib.nullcontext
    strategy = NativeFSDPStrategy(recipe.strategy)
    hubs = command_line_hubs(recipe.model.use_hf)
    model = strategy.from_pretrained(recipe.model.path, dtype=float_dtype(recipe.model.dtype), hubs=hubs)
    with timing_data():
        tokenizer = strategy.node_local_object(
            lambda: AutoTokenizer.from_pretrained(strategy.resolved_model_path(recipe.model.path, hubs=hubs)))
    if recipe.tuner.type == TunerType.LORA:
        from peft import get_peft_model

        torch.manual_seed(recipe.train.seed)  # same fresh adapter whatever the number of nodes
        with warnings.catch_warnings():
            # PeftModel.__init__ (peft 0.21) reads transformers' deprecated `is_gradient_checkpointing`: a
            # FutureWarning about a call neither we nor the user make (the value it reads is unchanged).
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            model = get_peft_model(model, lora_config(recipe))
    data = recipe.data
    with timing_data():
        dataset = SFTDataset.from_jsonl(list(data.dataset), tokenizer, data.max_length, data.packing,
                                        strict=data.strict, seed=recipe.train.seed,
                                        truncation_strategy=data.truncation_strategy)
        collator = data_collator(recipe, tokenizer, dataset, log=strategy.is_main_process)
    trainer = Trainer(model=model, strategy=strategy, args=recipe.train, train_dataset=dataset,
                      data_collator=collator, processing_class=tokenizer,
                      run_dir=run_dir, print_summary=print_summary,
                      model_path=_merge_release_path(recipe, strategy), start_clock=start_clock)
    return trainer, strategy


def _merge_release_path(recipe: Recipe, strategy: NativeFSDPStrategy) -> str | None:
    """The release's local directory, which only merge_lora in the release's format reads. Resolved only then: a
    rank that did not load the model (memory_efficient_init's receivers) must not open the hub caches otherwise."""
    if recipe.train.merge_lora and recipe.train.merged_format == "release":
        return strategy.resolved_model_path(recipe.model.path, hubs=command_line_hubs(recipe.model.use_hf))
    return None


def run_recipe(recipe: Recipe, run_dir: str | None = None, *, print_summary: bool = True) -> list[dict]:
    clock = StartClock()  # the trainer's start: what came before was the process's imports (or the launcher's)
    trainer, strategy = build_training(recipe, run_dir, print_summary=print_summary, start_clock=clock)
    try:
        return trainer.train()
    finally:
        strategy.shutdown()
