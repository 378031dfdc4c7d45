"""Without processes: safetensors headers checked as strictly as safetensors checks them, and directories that
exist under their final name only when complete."""

import json
import os

import pytest
import torch
from header_edit import corrupt_copy, read_header, write_with_header
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from twinkle_strategy.checkpoint.directories import (
    INCOMPLETE_MARKER,
    is_incomplete,
    pending_path,
    publish,
    publish_pending,
    raise_if_incomplete,
    start_pending,
)
from twinkle_strategy.checkpoint.reading import SafetensorsIndex
from twinkle_strategy.errors import CheckpointError, ResumeError
from twinkle_strategy.loading import config_from_text, read_config_text
from twinkle_strategy.sources.model_ids import resolve_model_path


@pytest.fixture
def good_file(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(4, 3), "c.bias": torch.randn(5),
               "d.scale": torch.ones((), dtype=torch.bfloat16)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("edit,message", [
    ("overlapping_offsets", r"tensor 'b.weight' \(data_offsets \[0, 48\]\) overlaps tensor 'a.weight'"),
    ("reversed_offsets", r"tensor '.*' has data_offsets \[\d+, \d+\]: its end is before its begin"),
    ("unknown_dtype", r"tensor 'a.weight' has dtype 'F33', which is not a safetensors dtype"),
    ("shape_not_matching_bytes", r"tensor 'a.weight' has \d+ bytes \(data_offsets \[\d+, \d+\]\) for shape .* which needs"),
])
def test_a_header_safetensors_rejects_is_rejected_naming_the_file(good_file, tmp_path, edit, message):
    bad = tmp_path / f"{edit}.safetensors"
    corrupt_copy(good_file, bad, edit)
    with pytest.raises(SafetensorError):  # the reference: safetensors itself refuses the file
        load_file(str(bad))
    with pytest.raises(CheckpointError, match=f"checkpoint file {bad} is corrupt: {message}"):
        SafetensorsIndex([str(bad)])


def test_gaps_trailing_bytes_and_truncation_are_rejected(good_file, tmp_path):
    header, data = read_header(good_file)
    gap = {k: dict(v) for k, v in header.items()}
    gap["c.bias"]["data_offsets"] = [o + 4 for o in gap["c.bias"]["data_offsets"]]
    gap["d.scale"]["data_offsets"] = [o + 4 for o in gap["d.scale"]["data_offsets"]]
    cases = {"gap": (gap, data + b"\0" * 4, r"bytes \[\d+, \d+\) before tensor '.*' belong to no tensor"),
             "trailing": (header, data + b"\0" * 8, "it has 8 bytes after its last tensor"),
             "truncated": (header, data[:-10], "is truncated: it has .* tensor\\(s\\) 'c.bias'")}
    for name, (edited, payload, message) in cases.items():
        bad = tmp_path / f"{name}.safetensors"
        write_with_header(bad, edited, payload)
        with pytest.raises(SafetensorError):
            load_file(str(bad))
        with pytest.raises(CheckpointError, match=message):
            SafetensorsIndex([str(bad)])


def test_a_good_file_reads_back_exactly(good_file):
    index = SafetensorsIndex([str(good_file)])
    try:
        for key, tensor in load_file(str(good_file)).items():
            assert torch.equal(index.read(key), tensor), key
        assert torch.equal(index.read("a.weight", (1, 3)), load_file(str(good_file))["a.weight"][1:3])
    finally:
        index.close()


def test_an_invalid_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe",, }')
    with pytest.raises(CheckpointError, match=f"{tmp_path}/config.json is not valid JSON .*line 1 column 28"):
        read_config_text(str(tmp_path))
    with pytest.raises(CheckpointError, match="/ckpt/config.json holds a JSON list"):
        config_from_text("[1, 2]", "/ckpt/config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model_type"}))
    with pytest.raises(CheckpointError, match=f"could not read the config of {tmp_path}/config.json"):
        config_from_text(read_config_text(str(tmp_path)), f"{tmp_path}/config.json")


def test_a_config_from_text_is_named_after_its_checkpoint(tmp_path):
    # As from_pretrained names it: PEFT writes it into adapter_config.json and reads its config.json when saving.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    config = config_from_text(read_config_text(str(tmp_path)), f"{tmp_path}/config.json")
    assert config.name_or_path == str(tmp_path)


def _save(directory, files: dict[str, str]) -> None:
    for name, text in files.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)


def test_a_staged_directory_gets_its_name_only_when_committed(tmp_path):
    final = str(tmp_path / "model")
    staging = start_pending(final)
    assert staging == pending_path(final) == final + ".tmp" and is_incomplete(staging)
    _save(staging, {"model.safetensors": "new", "config.json": "{}"})
    assert not os.path.exists(final)  # a kill now leaves no directory under the final name
    for error in (CheckpointError, ResumeError):
        with pytest.raises(error, match=f"{staging} is an incomplete save"):
            raise_if_incomplete(staging, error)
    with pytest.raises(CheckpointError, match="is an incomplete save"):
        resolve_model_path(staging)
    publish_pending(final)
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"] and not os.path.exists(staging)
    assert resolve_model_path(final) == final


def test_publish_replaces_and_commit_merges_into_a_directory_with_other_files(tmp_path):
    final = str(tmp_path / "checkpoint-2")
    os.makedirs(final)
    _save(final, {"model-00001-of-00002.safetensors": "old", "model-00002-of-00002.safetensors": "old",
                  "model.safetensors.index.json": "old", "notes.txt": "the user's"})
    staging = start_pending(final)
    _save(staging, {"model.safetensors": "new", "config.json": "{}"})
    publish_pending(final)  # merged: the user's file stays, the earlier save's weight files go
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors", "notes.txt"]
    assert not os.path.exists(os.path.join(final, INCOMPLETE_MARKER))
    staging = start_pending(final)
    _save(staging, {"trainer_state.json": "{}"})
    publish(staging, final)  # a training checkpoint is replaced whole
    assert os.listdir(final) == ["trainer_state.json"] and not os.path.exists(final + ".old")


def _checkpoint(run_dir, step: int, *, complete: bool = True, marked: bool = False) -> str:
    path = os.path.join(run_dir, f"checkpoint-{step}")
    os.makedirs(path)
    if complete:
        _save(path, {"trainer_state.json": json.dumps({"global_step": step})})
    if marked:
        _save(path, {INCOMPLETE_MARKER: ""})
    return path


def test_resume_and_rotation_ignore_incomplete_checkpoints(tmp_path):
    from twinkle_strategy.checkpoint import latest_checkpoint, load_checkpoint, rotate_checkpoints

    run = str(tmp_path)
    for step in (2, 4, 6):
        _checkpoint(run, step)
    marked = _checkpoint(run, 8, marked=True)  # e.g. copied while a save was being written
    _checkpoint(run, 10, complete=False)  # no trainer_state.json
    os.makedirs(os.path.join(run, "checkpoint-12.tmp"))
    assert latest_checkpoint(run) == os.path.join(run, "checkpoint-6")
    with pytest.raises(ResumeError, match=f"{marked} is an incomplete save"):
        load_checkpoint(marked, None, None, optimizer=None, scheduler=None, expect={})
    rotate_checkpoints(run, keep=2)  # the two newest complete ones stay; nothing incomplete counts or goes
    assert sorted(os.listdir(run)) == ["checkpoint-10", "checkpoint-12.tmp", "checkpoint-4", "checkpoint-6",
                                       "checkpoint-8"]


def test_the_manager_names_rotates_and_resumes_from_the_newest_complete_checkpoint(tmp_path):
    from types import SimpleNamespace

    from twinkle_strategy.checkpoint import CheckpointManager, CheckpointPolicy

    run = str(tmp_path / "run")
    for step in (2, 4, 10):
        _checkpoint(run, step)
    _checkpoint(run, 12, marked=True)
    _checkpoint(run, 14, complete=False)
    one_process = SimpleNamespace(is_main_process=True)
    manager = CheckpointManager(run, model=None, strategy=one_process, policy=CheckpointPolicy(interval=2))
    assert manager.path(4) == os.path.join(run, "checkpoint-4")
    assert manager.steps() == [2, 4, 10]  # by step, not by name; nothing incomplete
    assert [step for step in range(1, 9) if manager.should_save(step)] == [2, 4, 6, 8]
    assert not CheckpointManager(run, model=None, strategy=one_process).should_save(4)  # no interval
    assert manager.resume_path(None, restarted=False) is None  # a fresh run
    assert manager.resume_path(None, restarted=True) == manager.path(10)  # restarted by torchrun: its own newest
    assert manager.resume_path(run, restarted=False) == manager.path(10)  # a run directory: its newest
    assert manager.resume_path(manager.path(2), restarted=True) == manager.path(2)  # a checkpoint: itself
    assert CheckpointManager(str(tmp_path / "new"), model=None, strategy=one_process).resume_path(
        None, restarted=True) is None  # restarted before its first save: from the start
