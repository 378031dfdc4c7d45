"""The time from ``twinkle-sft`` to the first step, told once in one line with its parts.

    start: 23.4 s to the first step (plan 6.1 s, launch 2.0 s, imports 5.2 s, init 3.3 s, data 0.4 s, first step 6.4 s)

The parts follow one another on rank 0's machine, so they add up to the total:

============  =================================================================================================
plan          the memory plan of the fit check, in the launcher (0 when it was skipped)
launch        the rest of the launcher until rank 0's process started: Python and the launcher's imports, the
              recipe's checks, torchrun's start (with several attempts, the earlier ones too)
imports       rank 0's process start to the trainer's start: its imports (0 when it trains in the launcher)
init          the process group, the model (loaded or streamed), the adapters, FSDP2, the optimizer, the run
              directory: the trainer's start to its first step, less the data
data          the tokenizer and the dataset (read, templated, tokenized)
first step    the first optimizer step of the run (of a resumed run: its first step after the checkpoint)
============  =================================================================================================

The launcher (:class:`LaunchClock`) hands its part to the ranks in ``TWINKLE_LAUNCH_TIMES``, as it hands them the
plan's peak; a rank started without it (plain ``torchrun -m twinkle_strategy.train.cli``) counts from its own
process start and leaves plan and launch out. A process's start is read from Linux's ``/proc``; elsewhere it is
the time the clock was made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

LAUNCH_TIMES_ENV = "TWINKLE_LAUNCH_TIMES"


def process_start_time(pid: int | str = "self") -> float | None:
    """When process ``pid`` started, on ``time.time()``'s clock; None where ``/proc`` does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
        # Field 22, starttime, in clock ticks after boot; the fields are counted after the command's ")".
        started_after_boot = int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (since_boot - started_after_boot)


@dataclasses.dataclass(frozen=True)
class LauncherTimes:
    """What the launcher tells its ranks: when ``twinkle-sft`` started, the plan's seconds, when it launched them."""

    started: float  # time.time() seconds
    plan_s: float
    handed_over: float  # time.time() seconds: torchrun started, or training began in the launcher's own process

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> LauncherTimes | None:
        text = os.environ.get(LAUNCH_TIMES_ENV)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):  # not ours to fail a run on: the start line leaves the launcher's parts out
            return None


class LaunchClock:
    """The launcher's side: when ``twinkle-sft`` started, how long its plan took, when it handed over."""

    def __init__(self, started: float):
        self.started = started
        self.plan_s = 0.0

    @classmethod
    def of_this_process(cls) -> LaunchClock:
        """Started when this process did (``twinkle-sft`` as a command: its Python start-up counts)."""
        return cls(process_start_time() or time.time())

    @classmethod
    def now(cls) -> LaunchClock:
        """Started now (``main(argv)`` called from Python)."""
        return cls(time.time())

    @contextlib.contextmanager
    def planning(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.plan_s += time.perf_counter() - began

    @contextlib.contextmanager
    def handed_over(self):
        """The launch: its ranks (and a run in this process) read the launcher's times; gone afterwards, so that
        nothing started later from this process reads them."""
        os.environ[LAUNCH_TIMES_ENV] = LauncherTimes(self.started, self.plan_s, time.time()).to_env()
        try:
            yield
        finally:
            os.environ.pop(LAUNCH_TIMES_ENV, None)


@dataclasses.dataclass(frozen=True)
class StartTimes:
    """One start in seconds: from ``twinkle-sft``'s start (or the rank's) to the first step's end, and its parts
    (plan and launch None when no launcher told them)."""

    total: float
    plan: float | None
    launch: float | None
    imports: float
    init: float
    data: float
    first_step: float

    def parts(self) -> dict[str, float]:
        named = {"plan": self.plan, "launch": self.launch, "imports": self.imports, "init": self.init,
                 "data": self.data, "first step": self.first_step}
        return {name: seconds for name, seconds in named.items() if seconds is not None}

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.parts().items())
        return f"start: {self.total:.1f} s to the first step ({parts})"

    def log_fields(self) -> dict:
        """For the log entry after the first step (logging.jsonl): the total and each part, in seconds."""
        return {"start(s)": round(self.total, 3),
                "start_parts(s)": {name.replace(" ", "_"): round(s, 3) for name, s in self.parts().items()}}


class StartClock:
    """A rank's side, made when its trainer starts: the marks up to the first step."""

    def __init__(self, launcher: LauncherTimes | None = None):
        now = time.time()
        self.launcher = launcher if launcher is not None else LauncherTimes.from_env()
        process_started = process_start_time() or now
        # Training in the launcher's own process (or in one started before the hand-over): its imports were the
        # launcher's, counted in launch.
        self.rank_started = max(process_started, self.launcher.handed_over) if self.launcher else process_started
        self.trainer_started = now
        self.data_s = 0.0
        self.ready_at: float | None = None
        self.times: StartTimes | None = None  # after the first step
        self._fields_logged = False

    @contextlib.contextmanager
    def loading_data(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self.data_s += time.perf_counter() - began

    def ready(self) -> None:
        """Set up: the first step starts now."""
        self.ready_at = time.time()

    def first_step_done(self) -> StartTimes | None:
        """The start's parts, the first time it is called after :meth:`ready` (None any other time)."""
        if self.times is not None or self.ready_at is None:
            return None
        done, launcher = time.time(), self.launcher
        self.times = StartTimes(
            total=done - (launcher.started if launcher else self.rank_started), plan=launcher.plan_s if launcher else None,
            launch=self.rank_started - launcher.started - launcher.plan_s if launcher else None,
            imports=self.trainer_started - self.rank_started,
            init=self.ready_at - self.trainer_started - self.data_s, data=self.data_s,
            first_step=done - self.ready_at)
        return self.times

    def take_log_fields(self) -> dict:
        """The start's fields for the first log entry after the first step, once ({} before it and after)."""
        if self.times is None or self._fields_logged:
            return {}
        self._fields_logged = True
        return self.times.log_fields()
