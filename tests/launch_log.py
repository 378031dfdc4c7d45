"""Every process the suite starts, with the Python processes under it, for the launch table and the launch budget.

Start-up (each process imports torch and transformers: 5-8 s on 2 cores) is most of the suite's time, so the
suite counts what it starts. conftest.py installs :class:`RecordingPopen` as ``subprocess.Popen`` in the pytest
process: a launch is one program the tests start there (a torchrun agent of ``multinode.launch``, a ``twinkle-sft``
run, ``swift sft``, a one-process script); :func:`launch_group` makes the agents of one simulated-node launch one
row. A sampler thread walks /proc twice a second and counts the Python processes under each launch (agents, ranks,
the workers a CLI starts): any process that lives longer than a sample, which every rank does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# Programs that count as launches; a `git`, `ldconfig` or `uname` some library starts does not.
LAUNCHERS = ("python", "bash", "torchrun", "twinkle-sft", "swift")
SAMPLE_S = 0.5
REAL_POPEN = subprocess.Popen  # before install(): what starts a process that is no launch (tests/preload.py's servers)


@dataclasses.dataclass
class Launch:
    """One launch: which test started what, how many Python processes ran under it, and for how long."""
    test: str
    program: str
    started: float
    pids: set[int] = dataclasses.field(default_factory=set)  # the launch's own top-level processes
    python: set[int] = dataclasses.field(default_factory=set)  # the pid of each Python process under it
    ended: float | None = None
    forked: int = 0  # ranks forked from a preloaded interpreter (tests/preload.py)
    fallbacks: list[str] = dataclasses.field(default_factory=list)  # why each other rank of it started fresh
    preload_log: str | None = None  # its preload log (tests/preload.py), whose forked children the count follows

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def processes(self) -> int:
        return len(self.python)


LAUNCHES: list[Launch] = []  # this process's, and under pytest-xdist the controller's copy of every worker's


def to_records(launches: list[Launch]) -> list[dict]:
    """The launches as JSON-able records: what an xdist worker sends the controller (tests/conftest.py)."""
    return [{"test": x.test, "program": x.program, "seconds": x.seconds, "python": sorted(x.python),
             "forked": x.forked, "fallbacks": list(x.fallbacks)} for x in launches]


def from_records(records: list[dict]) -> list[Launch]:
    """A worker's launches, ended, in the controller: the table and the budget read them as the worker's own."""
    return [Launch(r["test"], r["program"], 0.0, python=set(r["python"]), ended=r["seconds"], forked=r["forked"],
                   fallbacks=list(r["fallbacks"])) for r in records]
_lock = threading.Lock()
_state = threading.local()
current_test = ["(collection)"]


def _program(args) -> str:
    argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
    argv = [str(a) for a in argv]
    name = os.path.basename(argv[0]) if argv else "?"
    # The script or module that matters: `python -m twinkle_strategy.train.cli`, `python tests/workers/x.py`.
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return f"{name} -m {argv[i + 1]}"
        if arg == "-c":
            return f"{name} -c"
        if arg.endswith((".py", ".sh")):
            return f"{name} {os.path.basename(arg)}"
    return name


def _counts(args) -> bool:
    argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
    return bool(argv) and os.path.basename(str(argv[0])).startswith(LAUNCHERS)


@contextlib.contextmanager
def launch_group(program: str) -> Iterator[Launch]:
    """The processes started inside this block are one launch (the node agents of one simulated-node run)."""
    record = Launch(current_test[0], program, time.monotonic())
    with _lock:
        LAUNCHES.append(record)
    _state.group = record
    try:
        yield record
    finally:
        _state.group = None
        record.ended = time.monotonic()


def one_launch(program: str):
    """Decorator: every process the function starts is one launch (a helper that starts one process per node)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with launch_group(program):
                return fn(*args, **kwargs)
        return inner
    return wrap


class RecordingPopen(subprocess.Popen):
    """``subprocess.Popen`` that records a launch (or joins the current :func:`launch_group`)."""

    def __init__(self, args, *rest, **kwargs):
        super().__init__(args, *rest, **kwargs)
        self._launch = None
        # A twinkle-sft launch whose ranks fork from the preload servers (tests/preload.py, cli_env) names its log here.
        self._preload_log = (kwargs.get("env") or {}).get("TWINKLE_PRELOAD_LOG")
        if not _counts(args):
            return
        group = getattr(_state, "group", None)
        if group is None:
            group = Launch(current_test[0], _program(args), time.monotonic(), preload_log=self._preload_log)
            with _lock:
                LAUNCHES.append(group)
            self._launch = group  # ends with this process
        with _lock:
            group.pids.add(self.pid)
            if os.path.basename(str(args[0] if not isinstance(args, (str, os.PathLike)) else args)).startswith("python"):
                group.python.add(self.pid)  # counted even when it ends before the first sample

    def _note_end(self):
        if self._launch is not None and self.returncode is not None and self._launch.ended is None:
            self._launch.ended = time.monotonic()
            if self._preload_log:
                from preload import outcomes  # not at the top: preload imports this module

                log = Path(self._preload_log)
                self._launch.forked, self._launch.fallbacks = outcomes(log)
                log.unlink(missing_ok=True)

    def poll(self):
        code = super().poll()
        self._note_end()
        return code

    def wait(self, timeout=None):
        code = super().wait(timeout)
        self._note_end()
        return code

    def communicate(self, *args, **kwargs):
        out = super().communicate(*args, **kwargs)
        self._note_end()
        return out


def _proc_table() -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, is Python), for every process now alive."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                exe = f.read().split(b"\0", 1)[0]
        except (OSError, IndexError):
            continue
        table[int(entry.name)] = (int(fields[1]), os.path.basename(exe).startswith(b"python"))
    return table


def _sample() -> None:
    with _lock:
        live = [launch for launch in LAUNCHES if launch.ended is None]
    if not live:
        return
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    for launch in live:
        forks = _forks(launch.preload_log)
        forked = set(forks.values())
        stack = [pid for pid in list(launch.pids) if pid in table]
        while stack:
            pid = stack.pop()
            if table[pid][1] and pid not in forked:  # a client stands for its forked child (counted once)
                launch.python.add(pid)
            stack.extend(children.get(pid, ()))
            if forks.get(pid) in table:  # a forked agent's ranks are under it, not under its client
                stack.append(forks[pid])


def _forks(preload_log: str | None) -> dict[int, int]:
    """Client pid -> the pid of the child the fork server forked for it, from a launch's preload log."""
    forks = {}
    if preload_log:
        try:
            with open(preload_log) as f:
                for line in f:
                    record = json.loads(line)
                    if record.get("child"):
                        forks[record["pid"]] = record["child"]
        except (OSError, ValueError):
            pass  # not written yet, or a line half-written: the next sample reads it
    return forks


def start_sampler() -> None:
    def loop():
        while True:
            try:
                _sample()
            except Exception:  # noqa: BLE001 - a count, never a reason for the suite to fail
                pass
            time.sleep(SAMPLE_S)

    threading.Thread(target=loop, name="launch-log", daemon=True).start()


def install() -> None:
    """Record every launch of this pytest process from now on."""
    from twinkle_strategy.train import launcher

    subprocess.Popen = RecordingPopen
    # twinkle-sft's main called in this process starts its node agents through run_agents: one launch, as
    # multinode.launch's are.
    run_agents = launcher.run_agents

    def grouped_run_agents(commands, *args, **kwargs):
        if getattr(_state, "group", None) is not None:
            return run_agents(commands, *args, **kwargs)
        with launch_group(f"{_program(commands[0])} {len(commands)} nodes" if commands else "run_agents"):
            return run_agents(commands, *args, **kwargs)

    launcher.run_agents = grouped_run_agents
    start_sampler()


def table_lines(limit: int = 25) -> list[str]:
    """The launch table: totals per test file, then the longest launches."""
    launches = list(LAUNCHES)
    files: dict[str, list[Launch]] = {}
    for launch in launches:
        files.setdefault(launch.test.split("::")[0], []).append(launch)
    total_s = sum(launch.seconds for launch in launches)
    lines = [f"{len(launches)} launches, {sum(x.processes for x in launches)} Python processes, "
             f"{total_s:.0f} s of launches (serial)",
             *preload_lines(launches),
             f"{'launches':>8} {'procs':>6} {'seconds':>8}  test file"]
    for name, group in sorted(files.items(), key=lambda kv: -sum(x.seconds for x in kv[1])):
        lines.append(f"{len(group):>8} {sum(x.processes for x in group):>6} {sum(x.seconds for x in group):>8.1f}  "
                     f"{name}")
    lines.append(f"the {min(limit, len(launches))} longest launches:")
    lines.append(f"{'procs':>6} {'seconds':>8}  program  (test)")
    for launch in sorted(launches, key=lambda x: -x.seconds)[:limit]:
        lines.append(f"{launch.processes:>6} {launch.seconds:>8.1f}  {launch.program}  ({launch.test})")
    return lines


def preload_lines(launches: list[Launch]) -> list[str]:
    """How many ranks were forked from a preloaded interpreter, and why the others started fresh (by reason)."""
    forked = sum(x.forked for x in launches)
    reasons: dict[str, int] = {}
    for launch in launches:
        for why in launch.fallbacks:
            reasons[why] = reasons.get(why, 0) + 1
    if not forked and not reasons:
        return []
    lines = [f"preloaded ranks and agents (tests/preload.py): {forked} forked, {sum(reasons.values())} started "
             "fresh"]
    lines += [f"  {n:>4} fresh: {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return lines
