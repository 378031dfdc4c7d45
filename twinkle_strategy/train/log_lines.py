"""The trainer's log line: what logging.jsonl and the console get after a logging window of steps.

The line keeps swift's field names (``global_step/max_steps``, ``memory(GiB)``, ``train_speed(s/it)``...), so that
a swift user's tools read it; the window's losses and MoE and throughput fields come from
:class:`~twinkle_strategy.train.metrics.StepWindow`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys

import torch

from twinkle_strategy.distributed.runtime import peak_rss_bytes
from twinkle_strategy.train.state import TrainState

# The step peak twinkle-sft's memory plan gave before launch (it sets this for its workers when it checked the fit).
PLANNED_PEAK_ENV = "TWINKLE_PLANNED_PEAK_BYTES"


def log_entry(state: TrainState, fields: dict, *, elapsed: float, device: torch.device, learning_rate: float,
              kept: dict) -> dict:
    """The log line after step ``state.global_step``: the window's ``fields`` (StepWindow.take), the schedule's
    progress, the memory peak and the plan beside it. ``kept``: the quantized base's fields (kept_weight_log)."""
    step = state.global_step
    speed = elapsed / max(step - state.start_step, 1)
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated() / 2**30
    else:
        memory = peak_rss_bytes() / 2**30
    return {
        "loss": round(fields["loss"], 6),
        "grad_norm": round(fields["grad_norm"], 6),
        "learning_rate": learning_rate,
        "epoch": round(state.epoch, 4),
        "global_step/max_steps": f"{step}/{state.max_steps}",
        "percentage": f"{100 * step / state.max_steps:.2f}%",
        "elapsed_time": _format_seconds(elapsed),
        "remaining_time": _format_seconds(speed * (state.max_steps - step)),
        "memory(GiB)": round(memory, 3),
        **_planned_memory(),  # the launcher's memory plan, beside the measured peak above
        "train_speed(s/it)": round(speed, 6),
        **kept,
        **fields["extra"],
    }


def _format_seconds(s: float) -> str:
    return str(datetime.timedelta(seconds=int(s)))


def _planned_memory() -> dict:
    """The step peak the memory plan gave before launch (twinkle-sft sets it when it checked the fit)."""
    planned = os.environ.get(PLANNED_PEAK_ENV)
    return {"planned_memory(GiB)": round(int(planned) / 2**30, 6)} if planned else {}


def print_line(text: str) -> None:
    """``text`` on stdout, on its own line above the progress bar (which is redrawn below it)."""
    from tqdm.auto import tqdm

    tqdm.write(text)
    sys.stdout.flush()


@contextlib.contextmanager
def lines_above(progress):
    """While the progress bar shows, the package's log lines go above it, as :func:`print_line` does."""
    if progress is None:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm([logging.getLogger("twinkle_strategy")]):
        yield
