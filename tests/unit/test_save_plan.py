"""The save executor in one process: the items each front-end declares, an item failing leaves nothing
half-written, and an asynchronous save writes the same files as a synchronous one (byte for byte).

A real tiny MoE model (and a PEFT LoRA of it) with a real AdamW step and scheduler, real safetensors files;
no process group: one process is a world of one (every rank's part is rank 0's).
"""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

from twinkle_strategy.checkpoint import CheckpointManager, CheckpointPolicy, SavePlan, execute_save
from twinkle_strategy.checkpoint.background import AsyncSaves
from twinkle_strategy.checkpoint.directories import INCOMPLETE_MARKER, pending_path
from twinkle_strategy.checkpoint.save_plan import (
    Adapter,
    FrontEndFiles,
    ModelConfig,
    ModelWeights,
    Publish,
    SaveContext,
    Tokenizer,
)
from twinkle_strategy.checkpoint.training import (
    TrainerStateFiles,
    TrainerStateJson,
    checkpoint_items,
    pretrained_items,
    save_pretrained,
)
from twinkle_strategy.errors import CheckpointSaveError
from twinkle_strategy.testing.tiny_models import build_tiny_model


class _OneProcess:
    """What a save asks of the strategy, for a model that is not sharded (no expert parallelism)."""

    ep_plan = None
    is_main_process = True
    timeout_s = None


def _trained(lora: bool):
    model = build_tiny_model("qwen2_moe", seed=0)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    batch = torch.tensor([[1, 2, 3, 4, 5]])
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


@pytest.fixture(scope="module")
def full():
    return _trained(lora=False)


@pytest.fixture(scope="module")
def lora():
    return _trained(lora=True)


def _files(root: str) -> dict[str, bytes]:
    found = {}
    for directory, _, names in os.walk(root):
        for name in names:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def test_each_front_end_declares_its_items(full, lora):
    model, optimizer, scheduler = full
    tokenizer = object()  # (declared, not written)
    assert [type(i) for i in pretrained_items(model)] == [ModelWeights, ModelConfig]
    assert [type(i) for i in pretrained_items(model, tokenizer=tokenizer)] == [ModelWeights, ModelConfig, Tokenizer]
    state = {"global_step": 3}
    items = checkpoint_items(model, optimizer=optimizer, scheduler=scheduler, trainer_state=state)
    assert [type(i) for i in items] == [ModelWeights, ModelConfig, TrainerStateFiles, TrainerStateJson]
    assert items[2] == TrainerStateFiles(optimizer, scheduler)
    assert items[3].content == state and items[3].content is not state  # as of the save: training appends to it
    weights_only = checkpoint_items(model, optimizer=optimizer, scheduler=scheduler, trainer_state=state,
                                    save_optimizer=False)
    assert weights_only[2] == TrainerStateFiles(None, scheduler)

    peft_model = lora[0]
    assert pretrained_items(peft_model) == [Adapter()]  # the adapter, whole (no base weights, no config)
    items = checkpoint_items(peft_model, optimizer=lora[1], scheduler=None, trainer_state=state)
    # An asynchronous checkpoint reads the adapter back from trainer_state/'s trainable files: nothing gathered.
    assert items[0] == Adapter(from_trainable_files=True)
    assert [type(i) for i in items] == [Adapter, TrainerStateFiles, TrainerStateJson]
    with pytest.raises(AttributeError):  # one frozen context per save, shared by its items
        SaveContext(directory="d", model=model, ep_plan=None, step_done=None, stats=None).directory = "e"


def _manager(folder: str, trained, *, async_save: bool) -> CheckpointManager:
    model, optimizer, scheduler = trained
    return CheckpointManager(folder, model=model, strategy=_OneProcess(), optimizer=optimizer, scheduler=scheduler,
                             policy=CheckpointPolicy(async_save=async_save, max_file_bytes=64 * 2**10))


@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_an_asynchronous_save_writes_the_files_a_synchronous_one_writes(tuner, request, tmp_path):
    trained = request.getfixturevalue(tuner)
    written = {}
    for mode in ("sync", "async"):
        manager = _manager(str(tmp_path / mode), trained, async_save=mode == "async")
        torch.manual_seed(7)  # the RNG state each save takes: the same in both
        random.seed(7)
        report = manager.save(2, {"global_step": 2, "log_history": [{"loss": 1.5}]})
        assert report.background == (mode == "async")
        if mode == "async":
            assert not os.path.exists(manager.path(2))  # copied into host memory; written in the background
            manager.wait()
        written[mode] = _files(manager.path(2))
        assert not os.path.exists(pending_path(manager.path(2)))
    sync, background = written["sync"], written["async"]
    weights = "adapter_model.safetensors" if tuner == "lora" else "model-00001-of-00003.safetensors"
    assert weights in sync and "trainer_state.json" in sync and "trainer_state/rng/rank0.pt" in sync, sorted(sync)
    assert any(name.startswith("trainer_state/optimizer") for name in sync), sorted(sync)
    assert sorted(background) == sorted(sync)
    differ = [name for name in sync if background[name] != sync[name]]
    assert not differ, f"an asynchronous save wrote other bytes into {differ}"


def _fails(directory: str) -> None:
    raise OSError(errno.ENOSPC, "No space left on device", os.path.join(directory, "extra.bin"))


def test_an_item_failing_leaves_nothing_half_written(full, tmp_path):
    model, optimizer, scheduler = full
    manager = _manager(str(tmp_path / "run"), full, async_save=False)
    manager.save(1, {"global_step": 1})
    before = _files(manager.path(1))
    # A front-end's file fails after the weights were written (into the pending directory).
    items = [*pretrained_items(model), FrontEndFiles("a front-end's file", _fails),
             TrainerStateFiles(optimizer, scheduler)]
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint-2 \(a front-end's file\) failed on rank\(s\) "
                                                  r"\[0\].*No space left on device.*previous checkpoints are untouched"):
        execute_save(SavePlan(manager.path(2), items), model=model, ep_plan=None)
    assert not os.path.exists(manager.path(2)) and not os.path.exists(pending_path(manager.path(2)))
    assert _files(manager.path(1)) == before
    assert manager.steps() == [1]

    # save_pretrained into a directory that holds other files: they stay, and nothing new is moved in.
    target = tmp_path / "export"
    target.mkdir()
    (target / "README.md").write_text("mine")
    with pytest.raises(CheckpointSaveError, match=r"\(a front-end's file\) failed"):
        save_pretrained(model, str(target), ep_plan=None,
                        items=[*pretrained_items(model), FrontEndFiles("a front-end's file", _fails)])
    assert _files(str(target)) == {"README.md": b"mine"}
    assert not os.path.exists(pending_path(str(target)))


def test_an_item_failing_in_the_background_leaves_nothing_half_written(full, tmp_path):
    model, optimizer, scheduler = full
    background = AsyncSaves(pin_memory=False)
    path = str(tmp_path / "checkpoint-3")
    items = [*pretrained_items(model), TrainerStateFiles(optimizer, scheduler), FrontEndFiles("a front-end's file",
                                                                                             _fails)]
    execute_save(SavePlan(path, tuple(items)), model=model, ep_plan=None, background=background)
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint-3 in the background .*a front-end's file into "
                                                  r".*No space left on device"):
        background.wait()
    assert not os.path.exists(path) and not os.path.exists(pending_path(path))


def test_in_place_writes_into_the_callers_directory_and_is_synchronous_only(full, tmp_path):
    model, optimizer, scheduler = full
    directory = tmp_path / "checkpoint-4"  # the HF Trainer's own checkpoint directory, which it finishes itself
    directory.mkdir()
    execute_save(SavePlan(str(directory), (TrainerStateFiles(optimizer, scheduler),), publish=Publish.IN_PLACE),
                 model=model, ep_plan=None)
    files = _files(str(directory))
    assert "trainer_state/scheduler.pt" in files and "trainer_state/optimizer.json" in files, sorted(files)
    assert INCOMPLETE_MARKER not in files and not os.path.exists(pending_path(str(directory)))
    with pytest.raises(ValueError, match="IN_PLACE is synchronous"):
        execute_save(SavePlan(str(directory), (), publish=Publish.IN_PLACE), model=model, ep_plan=None,
                     background=AsyncSaves(pin_memory=False))


def test_the_executor_alone_runs_a_saves_directory_and_checkpoint_stays_small():
    """Front-ends declare items; none spells a save out again (the pending directory's life: the executor's)."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "twinkle_strategy"
    lifecycle = re.compile(r"\b(start_pending|prepare_pending|publish_pending|abandon_pending|save_model_files|"
                           r"step_reporter)\(")
    owners = {"checkpoint/save_plan.py", "checkpoint/directories.py", "checkpoint/writing.py",
              "checkpoint/background.py", "distributed/fail_together.py"}
    spelled_out = {str(p.relative_to(package)): sorted(set(lifecycle.findall(p.read_text())))
                   for p in package.rglob("*.py") if str(p.relative_to(package)) not in owners}
    assert not {k: v for k, v in spelled_out.items() if v}, spelled_out
    modules = sorted(p.name for p in (package / "checkpoint").glob("*.py"))
    assert len(modules) <= 12 and "staging.py" not in modules, modules  # 15 before saves became data, 14 before I/O by direction
    assert not (package / "init" / "staging.py").exists()  # the init's buffers are its send pool
