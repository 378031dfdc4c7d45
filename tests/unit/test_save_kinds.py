"""Saves as data, once: what each kind of save writes is declared in one table (``SAVE_KINDS``), and every
front-end's synchronous and asynchronous saves declare their items through it.

The trainers are real: ``transformers.Trainer`` with the strategy mixin, and with the ms-swift plugin's mixin (swift's
hooks on the plain transformers trainer: swift itself is not installed here), in one process (a world of one,
gloo), each training a real tiny MoE model or a PEFT LoRA of it. What a save hands the executor is recorded on its way
in (the executor still runs and writes the files).
"""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import TrainingArguments

from twinkle_strategy.checkpoint import save_plan, training
from twinkle_strategy.checkpoint.save_plan import (
    Adapter,
    FrontEndFiles,
    ModelConfig,
    ModelWeights,
    SaveItem,
    Tokenizer,
)
from twinkle_strategy.checkpoint.training import (
    SAVE_KINDS,
    Part,
    SaveKind,
    SaveSources,
    TrainerStateFiles,
    TrainerStateJson,
    declare,
    model_kind,
)
from twinkle_strategy.integrations.transformers import async_save
from twinkle_strategy.testing.tiny_models import build_tiny_model

PACKAGE = Path(__file__).resolve().parents[2] / "twinkle_strategy"
DECLARATION = "checkpoint/training.py"
# The items a kind of save is made of. A front-end's own files (FrontEndFiles, the merged export's release files)
# are content it brings (SaveSources); where they go in a save is the declaration's.
DECLARED_ITEMS = {cls.__name__ for cls in (ModelWeights, ModelConfig, Adapter, Tokenizer, TrainerStateFiles,
                                           TrainerStateJson)}


def _writes(directory: str) -> None:
    """A front-end's own file (declared, not written here)."""


def test_each_kind_of_save_declares_its_parts_in_order():
    everything = SaveSources(tokenizer=object(), front_end_files=FrontEndFiles("its files", _writes),
                             front_end_state_files=FrontEndFiles("its state", _writes), trainer_state_json={"step": 1},
                             merged_names=frozenset({"w"}), merged_subdirectory=".merged",
                             release_files=FrontEndFiles("the release's files", _writes))
    kinds = {kind: [type(item) for item in declare(kind, sources=everything)] for kind in SaveKind}
    assert kinds == {
        SaveKind.FULL_MODEL: [ModelWeights, ModelConfig, Tokenizer, FrontEndFiles],
        SaveKind.LORA_ADAPTER: [Adapter, Tokenizer, FrontEndFiles],
        SaveKind.TRAINER_STATE: [TrainerStateFiles, FrontEndFiles, TrainerStateJson],
        SaveKind.MERGED_EXPORT: [ModelWeights, ModelConfig],
        SaveKind.MERGED_RELEASE_EXPORT: [ModelWeights, FrontEndFiles],
    }, kinds
    assert set(SAVE_KINDS) == set(SaveKind) and {p for parts in SAVE_KINDS.values() for p in parts} == set(Part)
    # What a front-end leaves out is not written; the rest is.
    assert declare(SaveKind.FULL_MODEL) == [ModelWeights(), ModelConfig()]
    assert declare(SaveKind.LORA_ADAPTER) == [Adapter()]
    assert declare(SaveKind.TRAINER_STATE) == [TrainerStateFiles()]
    assert declare(SaveKind.TRAINER_STATE, sources=SaveSources(model_only=True, trainer_state_json={"step": 1})) == [
        TrainerStateJson({"step": 1})]  # the HF Trainer's save_only_model
    assert declare(SaveKind.MERGED_RELEASE_EXPORT, sources=everything)[0] == ModelWeights(names=frozenset({"w"}),
                                                                                           subdirectory=".merged")
    # Kinds compose in the order given: a training checkpoint is its model's kind, then the trainer state.
    assert [type(i) for i in declare(SaveKind.LORA_ADAPTER, SaveKind.TRAINER_STATE)] == [Adapter, TrainerStateFiles]


def _items_made(source: str) -> list[str]:
    """The save items a module's code makes (calls), by class name: the names it defines or imports from the
    checkpoint package, or reaches as an attribute of it."""
    tree = ast.parse(source)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("twinkle_strategy.checkpoint") for alias in node.names
                if alias.name in DECLARED_ITEMS}
    imported |= {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name in DECLARED_ITEMS}
    made = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            made.add(node.func.id)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DECLARED_ITEMS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in {"save_plan", "training"}):
            made.add(node.func.attr)
    return sorted(made)


def test_the_declaration_is_the_only_place_save_items_are_made():
    """No front-end lists the items of a save: each says which kinds it saves and what it brings to them."""
    made = {name: items for path in PACKAGE.rglob("*.py")
            if (name := str(path.relative_to(PACKAGE))) != DECLARATION and (items := _items_made(path.read_text()))}
    assert not made, f"save items made outside {DECLARATION}'s declaration: {made}"
    assert _items_made((PACKAGE / DECLARATION).read_text()) == sorted(DECLARED_ITEMS)  # (the scan sees them there)


# ------------------------------------------------------------------------------------ the trainers' saves
@pytest.fixture(scope="module")
def strategy():
    """The strategy of a world of one; the process group is torn down after this module's tests."""
    from twinkle_strategy import NativeFSDPStrategy

    started = not dist.is_initialized()
    strategy = NativeFSDPStrategy(device_type="cpu")
    strategy.setup()
    yield strategy
    if started and dist.is_initialized():
        dist.destroy_process_group()


def _model(lora: bool):
    model = build_tiny_model("qwen2_moe", seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model


class _Recorded:
    """The items of every save handed to the executor, in order (the executor then carries it out)."""

    def __init__(self, monkeypatch) -> None:
        self.saves: list[list[SaveItem]] = []
        for module in (save_plan, training, async_save):
            real = module.execute_save
            monkeypatch.setattr(module, "execute_save", self._recording(real))

    def _recording(self, real):
        def execute_save(plan, **kwargs):
            self.saves.append(list(plan.items))
            return real(plan, **kwargs)
        return execute_save


def _described(items: list[SaveItem]) -> list[tuple]:
    """Items as comparable data: their class and fields, a front-end's own writer by what it writes."""
    described = []
    for item in items:
        fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
        if isinstance(item, FrontEndFiles):
            fields = {"what": item.what, "every_rank": item.every_rank, "here": item.here}
        if isinstance(item, Adapter):
            fields["write_files"] = item.write_files is not None  # (a new writer per save: swift's)
        described.append((type(item).__name__, tuple(sorted(fields.items(), key=lambda kv: kv[0]))))
    return described


def _files(root: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), root): Path(d, n).read_bytes()
            for d, _, names in os.walk(root) for n in names}


def _sync_and_async_saves(trainer, tmp_path, monkeypatch):
    """What ``save_model`` (synchronous: the HF Trainer's checkpoints and final save) and an asynchronous
    checkpoint hand the executor, and the files each wrote."""
    recorded = _Recorded(monkeypatch)
    trainer.save_model(str(tmp_path / "sync"))
    trainer.async_checkpoints.save_checkpoint()
    trainer.async_checkpoints.saves.wait()
    (sync,), (background,) = recorded.saves[:1], recorded.saves[1:]
    checkpoint = tmp_path / "out" / f"checkpoint-{trainer.state.global_step}"
    return sync, background, _files(str(tmp_path / "sync")), _files(str(checkpoint))


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_a_transformers_trainers_sync_and_async_saves_declare_the_same_kinds(strategy, tuner, tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    from twinkle_strategy.integrations.transformers import with_strategy

    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no")
    trainer = with_strategy(Trainer)(model=_model(lora=tuner == "lora"), args=args, strategy=strategy,
                                     async_save=True)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    batch = torch.tensor([[1, 2, 3, 4, 5]])
    trainer.model(input_ids=batch, labels=batch).loss.backward()  # one step: optimizer state to save
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    sync, background, sync_files, checkpoint_files = _sync_and_async_saves(trainer, tmp_path, monkeypatch)
    expected_model = [Adapter] if tuner == "lora" else [ModelWeights, ModelConfig]
    assert [type(i) for i in sync] == [*expected_model, FrontEndFiles], sync  # training_args.bin
    # The asynchronous checkpoint: the same kind of the model (its adapter read back at the commit), then the
    # trainer state, as the HF Trainer's own save writes it.
    model_part = [dataclasses.replace(i, from_trainable_files=False) if isinstance(i, Adapter) else i
                  for i in background[:len(sync)]]
    assert _described(model_part) == _described(sync)
    assert [type(i) for i in background[len(sync):]] == [TrainerStateFiles, FrontEndFiles, TrainerStateJson]
    assert background[len(sync)] == TrainerStateFiles(trainer.optimizer, trainer.lr_scheduler)
    # ... and so the same files, byte for byte.
    assert sync_files and {name: checkpoint_files.get(name) for name in sync_files} == sync_files, sorted(sync_files)

    # The synchronous checkpoint's trainer state (the HF Trainer writes its RNG state and trainer_state.json).
    recorded = _Recorded(monkeypatch)
    (tmp_path / "state").mkdir()
    trainer._save_optimizer_and_scheduler(str(tmp_path / "state"))
    assert recorded.saves == [[TrainerStateFiles(trainer.optimizer, trainer.lr_scheduler)]]


class SwiftTrainingArguments(TrainingArguments):
    """What swift's training arguments add that its trainer's saves read: ``--max_shard_size``."""

    max_shard_size: str = "5GB"


SwiftTrainingArguments = dataclasses.dataclass(SwiftTrainingArguments)


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_swifts_sync_and_async_saves_declare_the_same_items(strategy, tuner, tmp_path):
    """swift's ``save_model`` (its checkpoints without async_save, and its final save) is the shared mixin's, which
    declares what an asynchronous checkpoint declares (the test above): the model's kind of save, from what swift
    brings to it in both, its own files (``_save``) beside a full model's rows or after PEFT's adapter files. (The
    swift plugin's mixin on the plain transformers trainer: swift itself is not installed here; tests/swift_plugin
    compares the files of swift's synchronous and asynchronous runs byte for byte.)"""
    from transformers import Trainer

    from twinkle_strategy.integrations.swift.parts.state import STATE
    from twinkle_strategy.integrations.swift.parts.trainer import TwinkleTrainerMixin
    from twinkle_strategy.integrations.transformers import StrategyTrainerMixin, with_strategy

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(STATE, "strategy", strategy)  # what the plugin built from swift's arguments
        patch.setattr(STATE, "fsdp_options", {"async_save": True})  # --fsdp '{"twinkle": {"async_save": true}}'
        trainer = with_strategy(Trainer, mixin=TwinkleTrainerMixin)(
            model=_model(lora=tuner == "lora"),
            args=SwiftTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[]))
    assert type(trainer).save_model is StrategyTrainerMixin.save_model  # no save of swift's own that bypasses it
    assert type(trainer)._save_checkpoint is StrategyTrainerMixin._save_checkpoint
    kind = model_kind(trainer.model)
    declared = {mode: declare(kind, sources=trainer.model_save_sources(adapter_from_trainable_files=mode == "async"))
                for mode in ("sync", "async")}
    if tuner == "full":
        assert [type(i) for i in declared["sync"]] == [ModelWeights, ModelConfig, FrontEndFiles]
        assert (declared["sync"][2].what, declared["sync"][2].every_rank) == ("swift's files", True)
    else:
        assert declared["sync"] == [Adapter(write_files=declared["sync"][0].write_files)]  # PEFT's, then swift's
    model_part = [dataclasses.replace(i, from_trainable_files=False) if isinstance(i, Adapter) else i
                  for i in declared["async"]]
    assert _described(model_part) == _described(declared["sync"])
    trainer.checkpoint_started(str(tmp_path / "out" / "checkpoint-5"))  # what swift's own _save_checkpoint notes
    assert trainer.state.last_model_checkpoint == str(tmp_path / "out" / "checkpoint-5")
