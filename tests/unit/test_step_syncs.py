"""twinkle-sft's step waits for the device only at a log line: the host reads of real Trainer steps, counted.

A host read of a device value (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``nonzero``) makes
the host wait until the device has run every kernel queued before it: the device then idles while the host queues
the next work. The Trainer keeps a step's values on the device and reads them once per logging window.

The reads are counted on real steps (the tiny MoE demo model, one process, a world of one) through a dispatch mode
(``aten._local_scalar_dense``: what ``.item()``, ``float()`` and ``bool()`` of a tensor run; ``torch.equal``; and the
ops whose output size depends on the values, which a GPU must tell the host: ``nonzero``, ``unique``, indexing with
a boolean mask, ``masked_select``, ``repeat_interleave`` by a tensor) and a function mode (``Tensor.tolist`` /
``.cpu`` / ``.numpy``: on the CPU they never reach the dispatcher, on a GPU they copy to the host). A read is the package's when the innermost caller outside torch is in
``twinkle_strategy``; the model's own (transformers' causal-mask check) are the model's, as plain transformers runs
them too. The data path (``twinkle_strategy/train/data.py``: the sampler's order, the collator) works on host tensors
that never reach the device, so its reads are no syncs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys

import pytest
import torch
import torch.distributed as dist
from launches import DATASET
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer

import twinkle_strategy
from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
from twinkle_strategy.train.trainer import Trainer, TrainingArguments

PACKAGE = os.path.dirname(twinkle_strategy.__file__) + os.sep
TORCH = os.path.dirname(torch.__file__) + os.sep
HOST_DATA = os.path.join(PACKAGE, "train", "data.py")
HOST_READS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}
aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.argwhere.default,
                aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                aten.masked_select.default, aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
MASK_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def waits_for_values(func, args) -> bool:
    """Whether ``func`` on ``args`` makes a GPU tell the host a value (a scalar, or an output size it computed)."""
    if func in SCALAR_READS:
        return True
    if func in MASK_INDEXING:  # a boolean mask's True count is the output's size (a tensor index of ints is not)
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
    return False
STEPS = 4


@dataclasses.dataclass(frozen=True)
class HostRead:
    step: int  # the loop's optimizer step, 1-based (0: outside the loop)
    phase: str  # "step" | "log" | "save"
    site: str  # file:line:function of the package's innermost frame


class _Reads:
    """The package's host reads while open, placed in the Trainer's loop by its frames (``_run_steps``'s ``step``,
    and whether ``_log`` or ``save`` is running)."""

    PHASES = {Trainer._log.__code__: "log", Trainer.save.__code__: "save"}

    def __init__(self) -> None:
        self.reads: list[HostRead] = []
        counter = self

        class Scalars(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if waits_for_values(func, args):
                    counter.record()
                return func(*args, **(kwargs or {}))

        class Copies(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func in HOST_READS:
                    counter.record()
                return func(*args, **(kwargs or {}))

        self.modes = (Copies(), Scalars())

    def __enter__(self) -> _Reads:
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)

    def record(self) -> None:
        frame, caller = sys._getframe(2), None
        while frame is not None and caller is None:  # the innermost caller outside torch (and outside this file)
            name = frame.f_code.co_filename
            if not name.startswith(TORCH) and name != __file__:
                caller = frame
            frame = frame.f_back
        if caller is None or not caller.f_code.co_filename.startswith(PACKAGE) \
                or caller.f_code.co_filename == HOST_DATA:
            return  # the model's own (transformers), or host data
        step, phase = 0, "step"
        frame = caller
        while frame is not None:
            if frame.f_code in self.PHASES and phase == "step":
                phase = self.PHASES[frame.f_code]
            if frame.f_code is Trainer._run_steps.__code__:
                step = frame.f_locals["step"] + 1
            frame = frame.f_back
        site = f"{os.path.relpath(caller.f_code.co_filename, PACKAGE)}:{caller.f_lineno}:{caller.f_code.co_name}"
        self.reads.append(HostRead(step=step, phase=phase, site=site))


@pytest.fixture(scope="module")
def strategy():
    """The strategy of a world of one; the process group is torn down after this module's tests."""
    from twinkle_strategy import NativeFSDPStrategy

    started = not dist.is_initialized()
    strategy = NativeFSDPStrategy(device_type="cpu", mixed_precision="no")
    strategy.setup()
    yield strategy
    if started and dist.is_initialized():
        dist.destroy_process_group()


def test_a_step_reads_nothing_on_the_host_and_the_log_line_reads_a_fixed_few(strategy, demo_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    # Two micro-batches a step and the global-batch aux loss: the router pre-pass, the aux share, per-micro-batch
    # token counts all run. One window of STEPS steps: lines after step 1 (always) and step STEPS (the window's).
    args = TrainingArguments(output_dir=str(tmp_path), add_version=False, max_steps=STEPS, logging_steps=STEPS,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, router_aux_loss_coef=0.01)
    trainer = Trainer(model=strategy.from_pretrained(demo_model), strategy=strategy, args=args,
                      train_dataset=SFTDataset.from_jsonl(DATASET, tokenizer, max_length=48),
                      data_collator=DataCollatorForSFT(tokenizer.pad_token_id), print_summary=False)
    trainer.setup()  # (the set-up reads what it likes: it runs once)
    with _Reads() as counted:
        history = trainer.train()
    assert [e["global_step/max_steps"] for e in history] == ["1/4", "4/4"]

    in_steps = [r for r in counted.reads if r.phase == "step" and r.step > 1]
    assert in_steps == [], "host syncs inside a training step (they belong in the log line):\n" + "\n".join(
        map(str, in_steps))
    # The first step's own: once per run, the first forward judges the model's load-balancing formula (a refusal
    # in one line before training goes on: moe/balance.py's check_matches_model).
    first = {r.site.split(":")[0] for r in counted.reads if r.phase == "step" and r.step == 1}
    assert first <= {"moe/balance.py", "moe/balance_form.py"}, first
    per_log = collections.Counter(r.step for r in counted.reads if r.phase == "log")
    # The line after 1 step and the line after 3 more read the same 8 values: what a window reads does not grow with
    # its steps. 5 wait for a GPU (the losses in one copy, the last grad norm, the token sums, the expert counts, the
    # routing agreement's counts); 3 read the expert counts' host copy (on the CPU every read is counted).
    assert set(per_log) == {1, STEPS} and per_log[1] == per_log[STEPS] == 8, (
        per_log, sorted(r.site for r in counted.reads if r.phase == "log"))
