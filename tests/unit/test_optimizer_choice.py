"""twinkle-sft's AdamW: fused by default (``train.optim``, transformers' names), and a checkpoint saved with one
implementation resumes with the other.

A real tiny MoE and twinkle-sft's own ``Trainer._make_optimizer``; saved and read back through the real checkpoint
files (one process is a world of one, as in test_save_plan.py). Fused and foreach AdamW keep the same state
(``step``, ``exp_avg``, ``exp_avg_sq``); they are not bit-identical updates in general, so the resumed state is
compared, and the step after it against a run that kept the resumed implementation all along.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from twinkle_strategy.checkpoint import CheckpointManager, CheckpointPolicy
from twinkle_strategy.testing.tiny_models import build_tiny_model
from twinkle_strategy.train.arguments import OPTIMIZERS, OptimizerName, TrainingArguments
from twinkle_strategy.train.errors import RecipeError
from twinkle_strategy.train.trainer import Trainer

BATCH = torch.tensor([[1, 2, 3, 4, 5, 6]])


class _OneProcess:
    """What a save asks of the strategy, for a model that is not sharded (no expert parallelism)."""

    ep_plan = None
    is_main_process = True
    timeout_s = None


def _trainer(optim: str | None, dtype=torch.float32) -> Trainer:
    """twinkle-sft's Trainer with its optimizer built as setup() builds it (``optim=None``: the default)."""
    args = TrainingArguments(learning_rate=1e-2, weight_decay=0.1) if optim is None else \
        TrainingArguments(learning_rate=1e-2, weight_decay=0.1, optim=optim)
    model = build_tiny_model("qwen2_moe", seed=0).to(dtype)
    trainer = Trainer(model=model, strategy=None, args=args, train_dataset=None, data_collator=None)
    trainer._make_optimizer()
    return trainer


def _step(trainer: Trainer) -> None:
    trainer.model(input_ids=BATCH, labels=BATCH).loss.backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()


def _manager(folder, trainer: Trainer) -> CheckpointManager:
    return CheckpointManager(str(folder), model=trainer.model, strategy=_OneProcess(), optimizer=trainer.optimizer,
                             scheduler=None, policy=CheckpointPolicy(max_file_bytes=64 * 2**10))


def _state(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_is_the_default_and_adamw_torch_is_foreach(dtype):
    assert TrainingArguments().optim == "adamw_torch_fused" == OPTIMIZERS[0]
    for optim, fused, foreach in ((None, True, False), ("adamw_torch_fused", True, False),
                                  ("adamw_torch", False, True)):
        trainer = _trainer(optim, dtype)
        (group,) = trainer.optimizer.param_groups
        assert (group["fused"], group["foreach"]) == (fused, foreach), optim
        _step(trainer)  # torch has the kernel on the CPU, in fp32 and bf16
        assert all(s["step"] == 1 for s in trainer.optimizer.state.values())


def test_an_unknown_optimizer_names_the_option_and_the_accepted_values():
    with pytest.raises(RecipeError, match=r"optim='sgd' is not an AdamW implementation twinkle-sft has; use one "
                                          r"of adamw_torch_fused, adamw_torch") as info:
        TrainingArguments(optim="sgd")
    assert info.value.key == "train.optim"
    assert {o.torch_options()["fused"] for o in OptimizerName} == {True, False}


@pytest.mark.parametrize("saved,resumed", [("adamw_torch_fused", "adamw_torch"), ("adamw_torch", "adamw_torch_fused")])
def test_a_checkpoint_resumes_with_the_other_implementation(saved, resumed, tmp_path):
    first = _trainer(saved)
    _step(first)
    _step(first)
    _manager(tmp_path / "run", first).save(2, {"global_step": 2, "global_batch": 1})
    with open(os.path.join(tmp_path, "run", "checkpoint-2", "trainer_state", "optimizer.json")) as f:
        group = json.load(f)["param_groups"][0]
    assert (group["fused"], group["foreach"]) == (saved == "adamw_torch_fused", saved == "adamw_torch")

    second = _trainer(resumed)
    _manager(tmp_path / "run", second).load(str(tmp_path / "run" / "checkpoint-2"), expect={"global_step": 2})
    (group,) = second.optimizer.param_groups
    # This run's implementation, the saved hyper-parameters and state.
    assert (group["fused"], group["foreach"]) == (resumed == "adamw_torch_fused", resumed == "adamw_torch")
    assert (group["lr"], group["weight_decay"]) == (1e-2, 0.1)
    expected, got = _state(first), _state(second)
    assert got.keys() == expected.keys() and len(got) > 10
    for name, state in expected.items():
        assert got[name].keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, value in state.items():
            assert got[name][key].dtype == value.dtype and torch.equal(got[name][key], value), (name, key)

    # The next step is the resumed implementation's: the same as the first run's, continued with it.
    continued = _trainer(resumed)
    continued.model.load_state_dict(first.model.state_dict())
    continued.optimizer.load_state_dict(first.optimizer.state_dict())
    continued.optimizer.param_groups[0].update(OptimizerName(resumed).torch_options())
    _step(second)
    _step(continued)
    for (name, got_p), want in zip(second.model.named_parameters(), continued.model.parameters(), strict=True):
        assert torch.equal(got_p, want), name
