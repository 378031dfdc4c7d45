"""Checkpoints: what users load (adapter or full safetensors) and what resume needs (per-rank state).

Layout of ``checkpoint-{step}/`` (like ms-swift / transformers):

* LoRA runs: ``adapter_model.safetensors`` + ``adapter_config.json`` with the
  full adapter (all experts), loadable by plain PEFT on one process.
* Full runs: ``model.safetensors`` + ``config.json``, loadable by ``from_pretrained``.
* ``trainer_state/rank{R}.pt``: this rank's trainable shards, optimizer state,
  scheduler and RNG state; ``trainer_state.json`` written last.

Every checkpoint is written to ``checkpoint-{step}.tmp`` and renamed once all
ranks have finished, so a crash mid-save never leaves a directory that resume
would take for a checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.fail_together import RanksFailedError, raise_together

STATE_FILE = "trainer_state.json"


class ResumeError(TwinkleError):
    """A checkpoint that cannot be resumed from (incomplete, or saved with another parallel layout)."""


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def trainable_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CheckpointSaveError(RanksFailedError):
    """Saving a checkpoint failed on some rank; previous checkpoints are untouched."""


def save_checkpoint(path: str, model, strategy, optimizer, scheduler, trainer_state: dict, tokenizer=None,
                    save_optimizer: bool = True) -> str:
    """Write ``path`` atomically (collective: every rank calls it).

    Each step ends with a fail-together check instead of a plain barrier: if
    any rank cannot write (disk full, permissions), every rank raises the same
    error and the half-written ``.tmp`` directory is removed. A process killed
    mid-save leaves only ``.tmp``, which resume ignores.
    """
    tmp = path + ".tmp"
    step = os.path.basename(path)

    def step_done(error: BaseException | None, what: str) -> None:
        try:
            raise_together(error, f"saving {step} ({what})")
        except RanksFailedError as exc:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(f"{exc}; previous checkpoints are untouched", exc.failures) from error

    error = None
    if _rank() == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "trainer_state"))
        except OSError as exc:
            error = exc
    step_done(error, "creating the directory")
    peft = is_peft_model(model)
    keys = trainable_names(model) if peft else None
    # Collective gather; only rank 0 keeps the tensors.
    state = strategy.full_state_dict(model, rank0_only=True, keys=keys)
    error = None
    if _rank() == 0:
        try:
            if peft:
                model.save_pretrained(tmp, state_dict=state)
            else:
                model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            error = exc
    del state
    step_done(error, "model weights")
    error = None
    try:
        local = {
            "params": {n: _local(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad},
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "optimizer": _optimizer_to_local(optimizer.state_dict()) if (optimizer is not None and save_optimizer)
            else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        torch.save(local, os.path.join(tmp, "trainer_state", f"rank{_rank()}.pt"))
    except Exception as exc:  # noqa: BLE001
        error = exc
    step_done(error, "trainer state")
    error = None
    if _rank() == 0:
        try:
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(trainer_state, f, indent=2)
            # The rename is the commit point: before it, resume never sees this checkpoint.
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
        except Exception as exc:  # noqa: BLE001
            error = exc
    step_done(error, "finalising")
    return path


def _optimizer_to_local(state_dict: dict) -> dict:
    # DTensor states become their local shards; resume rebuilds them from the parameters' placements.
    return {
        "state": {i: {k: _local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for i, s in state_dict["state"].items()},
        "param_groups": state_dict["param_groups"],
    }


def _optimizer_from_local(local: dict, optimizer) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in local["state"].items():
        p = params[int(i)]
        state[i] = {}
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.dim() > 0:
                v = DTensor.from_local(v.to(_local(p).device), p.device_mesh, p.placements,
                                       shape=p.shape, stride=p.stride())
            state[i][k] = v
    return {"state": state, "param_groups": local["param_groups"]}


def load_checkpoint(path: str, model, optimizer, scheduler, expect: dict) -> dict:
    """Restore this rank's shards, optimizer, scheduler and RNG from ``path``; return the trainer state."""
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise ResumeError(f"{path} is not a complete checkpoint (no {STATE_FILE}); pick another checkpoint-* "
                          "directory")
    with open(state_path) as f:
        trainer_state = json.load(f)
    for key, value in expect.items():
        if trainer_state.get(key) != value:
            raise ResumeError(f"checkpoint {path} was saved with {key}={trainer_state.get(key)}, this run has "
                              f"{key}={value}; resume with the same parallel layout")
    rank_file = os.path.join(path, "trainer_state", f"rank{_rank()}.pt")
    local = torch.load(rank_file, map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in local["params"].items():
            if name not in params:
                raise ResumeError(f"checkpoint {path} has parameter '{name}' that this model does not have")
            _local(params[name]).copy_(tensor)
    if optimizer is not None and local["optimizer"] is not None:
        optimizer.load_state_dict(_optimizer_from_local(local["optimizer"], optimizer))
    if scheduler is not None and local["scheduler"] is not None:
        scheduler.load_state_dict(local["scheduler"])
    torch.set_rng_state(local["rng"]["torch"])
    random.setstate(local["rng"]["python"])
    return trainer_state


def latest_checkpoint(run_dir: str) -> str | None:
    """The complete checkpoint with the highest step in ``run_dir`` (``.tmp`` leftovers are ignored)."""
    found = []
    for path in glob.glob(os.path.join(run_dir, "checkpoint-*")):
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def rotate_checkpoints(run_dir: str, keep: int | None) -> None:
    if not keep:
        return
    complete = []
    for path in glob.glob(os.path.join(run_dir, "checkpoint-*")):
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if m:
            complete.append((int(m.group(1)), path))
    for _, path in sorted(complete)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
