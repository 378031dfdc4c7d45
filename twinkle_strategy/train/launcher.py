"""Start torchrun agents and wait for them: simulated nodes, and twinkle-sft's launches with per-rank logs.

On a real cluster you run one ``torchrun --nnodes N --node_rank i ...`` per
node. Simulated nodes are several torchrun agents on 127.0.0.1 (demos, tests), so
each rank sees RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK exactly as it
would there. :func:`run_logged` is how ``twinkle-sft`` runs either: every rank's
output in a log file, one rank on the terminal, one summary if the run fails.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from twinkle_strategy.checkpoint import latest_checkpoint
from twinkle_strategy.sources.demo import demo_model_path
from twinkle_strategy.train.errors import RunStoppedError
from twinkle_strategy.train.ports import MasterPortTaken, master_port_taken, on_a_free_port
from twinkle_strategy.train.ports import free_port as free_port  # re-exported: launches import it from here
from twinkle_strategy.train.ports import port_in_use as port_in_use
from twinkle_strategy.train.rank_logs import (
    RUN_DIR_ENV,
    LogFollower,
    agent_log_path,
    failure_summary,
    logs_dir,
    rank_log_path,
)
from twinkle_strategy.train.torchrun import torchrun_command


def device_problem(device_type: str | None, backend: str | None = None) -> str | None:
    """One line if the device the recipe names (``strategy.device_type``, or its ``strategy.backend``) is missing."""
    needs = {device_type, {"nccl": "cuda", "hccl": "npu"}.get(backend or "")}
    if "cuda" in needs:
        import torch

        if not torch.cuda.is_available():
            return ("the recipe needs a CUDA GPU (strategy.device_type or strategy.backend) and torch sees none "
                    f"(torch {torch.__version__}, CUDA {torch.version.cuda}); run it on a GPU node, "
                    "or use strategy.device_type=cpu (--device_type cpu) to try it on CPU")
    if "npu" in needs:
        import importlib.util

        available = False
        if importlib.util.find_spec("torch_npu") is not None:
            import torch_npu

            available = torch_npu.npu.is_available()
        if not available:
            return ("the recipe needs an Ascend NPU (strategy.device_type or strategy.backend) and "
                    + ("torch_npu sees none" if importlib.util.find_spec("torch_npu") else "torch_npu is not installed")
                    + "; run it on an NPU node, or use strategy.device_type=cpu (--device_type cpu) to try it on CPU")
    return None


def waiting_line(nnodes: int, node_rank: int, nproc: int, master_addr: str, port: int) -> str:
    """What a launch of one node of several waits for, and how to start the other nodes."""
    others = [n for n in range(nnodes) if n != node_rank]
    addr = socket.gethostname() if master_addr in ("127.0.0.1", "localhost") and node_rank == 0 else master_addr
    starts = " / ".join(f"NODE_RANK={n}" for n in others)
    return (f"twinkle-sft: node {node_rank} of {nnodes} is waiting for node(s) {', '.join(map(str, others))} "
            f"to join at {master_addr}:{port}; start each with the same command and "
            f"NNODES={nnodes} NPROC_PER_NODE={nproc} {starts} MASTER_ADDR={addr} MASTER_PORT={port} on the other node "
            f"(Ctrl-C stops this one)")


@dataclasses.dataclass
class AgentsResult:
    returncodes: list[int | None]  # one per node agent; None where it was killed at the time limit
    timed_out: bool
    log_paths: list[Path | None]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def run_simulated_nodes(
    script_and_args: list[str],
    nnodes: int = 2,
    nproc_per_node: int | list[int] = 2,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    cwd: str | None = None,
    node_env: list[dict[str, str]] | None = None,
    python: str | None = None,
) -> AgentsResult:
    """Run ``script_and_args`` under ``nnodes`` torchrun agents and wait for all of them.

    With ``log_dir`` each agent's output goes to ``node{i}.log``; otherwise to
    this process's stdout. Past ``timeout`` seconds every agent and worker is killed.
    ``node_env[i]`` adds to node i's environment what differs between real nodes (e.g. a local disk).
    ``python``: the interpreter of the agents and workers (see :func:`torchrun_command`).
    """
    per_node = nproc_per_node if isinstance(nproc_per_node, list) else [nproc_per_node] * nnodes
    log_paths = [None if log_dir is None else Path(log_dir) / f"node{node}.log" for node in range(nnodes)]
    start = time.monotonic()
    env = {**os.environ, **(env or {})}
    envs = [{**env, **(node_env[node] if node_env else {})} for node in range(nnodes)]

    def launch(port: int, retry_if_taken: bool) -> tuple[list[int | None], bool]:
        commands = [torchrun_command(script_and_args, nnodes, node, per_node[node], port, python=python)
                    for node in range(nnodes)]
        return run_agents(commands, envs, log_paths, timeout=timeout, cwd=cwd, retry_if_port_taken=retry_if_taken)

    returncodes, timed_out = on_a_free_port(launch)
    return AgentsResult(returncodes, timed_out, log_paths, time.monotonic() - start)


WAITING_EVERY_ENV = "TWINKLE_WAITING_EVERY_S"  # seconds between the waiting line's repetitions (tests shorten it)


def waiting_every_s() -> float:
    """How often the waiting line repeats: every minute, or ``TWINKLE_WAITING_EVERY_S`` seconds."""
    return float(os.environ.get(WAITING_EVERY_ENV, "60"))


def run_logged(commands: list[list[str]], run_dir: str, ranks: list[int], node_ranks: list[int],
               waiting: str | None = None, waiting_after_s: float = 3.0, retry_if_port_taken: bool = False) -> bool:
    """Run torchrun agents (``commands``, one per node) whose workers log to ``run_dir/logs``.

    The workers (``twinkle-sft``) find ``run_dir`` in ``TWINKLE_RUN_DIR``. The first of
    ``ranks`` is shown live on stderr; a failed run ends with one summary on stderr
    (:mod:`twinkle_strategy.train.rank_logs`). Returns whether every agent succeeded.
    ``waiting``: the line printed (after ``waiting_after_s``, then every :func:`waiting_every_s`) while no
    rank of this node has started, i.e. while torchrun waits for the other nodes. SIGTERM or SIGINT stops
    every process of the run (:class:`RunStopper`) and raises ``RunStoppedError``, whose one line says where
    the last checkpoint is; the rank's output after the signal (its save) stays in its log.
    ``retry_if_port_taken``: as :func:`run_agents` (for a port this process picked, :func:`on_a_free_port`).
    """
    os.makedirs(logs_dir(run_dir), exist_ok=True)
    env = {**os.environ, RUN_DIR_ENV: run_dir, "PYTHONUNBUFFERED": "1"}
    follower = LogFollower(run_dir, ranks[0], sys.stderr.buffer)
    start, last_said, every_s = time.monotonic(), None, waiting_every_s()

    def while_waiting() -> None:
        nonlocal last_said
        if stopper.signum is not None:  # stopping: the terminal gets one line at the end, not the rank's save
            follower.stopped = True
            return
        follower.poll()
        if waiting is None:
            return
        now = time.monotonic()
        if now - start < waiting_after_s or (last_said is not None and now - last_said < every_s):
            return
        if not any(os.path.exists(rank_log_path(run_dir, r)) for r in ranks):
            print(waiting, file=sys.stderr, flush=True)
            last_said = now

    stopper = RunStopper()
    returncodes, _ = run_agents(commands, env, [Path(agent_log_path(run_dir, n)) for n in node_ranks],
                                while_waiting=while_waiting, stopper=stopper,
                                retry_if_port_taken=retry_if_port_taken)
    if stopper.signum is not None:
        follower.stopped = True
        follower.end_line()  # a progress bar left mid-line
        checkpoint = latest_checkpoint(run_dir)
        raise RunStoppedError(f"stopped by {signal.Signals(stopper.signum).name}; every process of the run has "
                              f"ended; last checkpoint: {checkpoint or 'none saved'} (logs in {logs_dir(run_dir)})",
                              stopper.signum)
    follower.finish()
    if all(rc == 0 for rc in returncodes):
        return True
    print(failure_summary(run_dir, ranks, node_ranks), file=sys.stderr, flush=True)
    return False


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc (empty where there is none)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(name)] = (int(fields[1]), fields[19])  # ppid, starttime
    return table


def descendants(pids: list[int]) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pids`` (Linux /proc; empty elsewhere)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def alive(processes: dict[int, str]) -> list[int]:
    """Those of ``processes`` (pid -> start time, from :func:`descendants`) still running, not reused pids."""
    table = _process_table()
    return [pid for pid, started in processes.items() if pid in table and table[pid][1] == started
            and not _is_zombie(pid)]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class RunStopper:
    """Owns the processes of a run: SIGTERM or SIGINT to this process reaches torchrun and every rank.

    torchrun starts each worker in a session of its own, so killing an agent's process group misses them;
    the stopper keeps the pids of every descendant of the agents (with their start times, so a reused pid is
    never signalled). On the first signal every rank gets SIGTERM (the trainer checkpoints at the end of its
    step and exits 0; :mod:`twinkle_strategy.train.preemption`), or the agents do while no rank exists yet;
    ``grace_s`` later (``TWINKLE_STOP_GRACE_S``), or at a second signal, everything left is killed.
    """

    def __init__(self, grace_s: float | None = None, handle_signals: bool = True):
        self.handle_signals = handle_signals
        self.grace_s = float(os.environ.get("TWINKLE_STOP_GRACE_S", "20")) if grace_s is None else grace_s
        self.signum: int | None = None
        self.kill_at: float | None = None
        self.agents: list[subprocess.Popen] = []
        self.known: dict[int, str] = {}  # descendant pid -> start time
        self._previous: dict[int, object] = {}
        self._last_scan = 0.0

    def install(self) -> None:
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:  # the second one: now
            self.kill_at = 0.0
            return
        self.signum = signum
        self.kill_at = time.monotonic() + self.grace_s
        self.scan()
        workers = [pid for pid in list(self.known) if pid not in {a.pid for a in self.agents}]
        ranks = [pid for pid in workers if self._parent_is_agent(pid)]
        # Nothing printed here: the run ends in one line (run_logged), as a torchrun or swift user expects.
        targets = ranks or [a.pid for a in self.agents if a.poll() is None]
        for pid in targets:
            self._signal(pid, signal.SIGTERM)

    def _parent_is_agent(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        return ppid in {a.pid for a in self.agents}

    def scan(self) -> None:
        """Add the live descendants of the agents to the pids this stopper owns."""
        self._last_scan = time.monotonic()
        self.known.update(descendants([a.pid for a in self.agents if a.poll() is None]))

    def poll(self) -> None:
        if time.monotonic() - self._last_scan > 1.0:
            self.scan()
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            self.kill_all()

    def _signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill_all(self) -> None:
        """SIGKILL every agent (with its process group) and every descendant still alive."""
        self.scan()
        for agent in self.agents:
            if agent.poll() is None:
                try:
                    os.killpg(agent.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in alive(dict(self.known)):
            self._signal(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.wait()


def _raise_if_port_taken(node0: subprocess.Popen, log_path: Path | None, retry: bool) -> None:
    if retry and node0.poll() not in (None, 0) and master_port_taken(log_path):
        raise MasterPortTaken(f"node 0's master port was taken ({log_path})")


def run_agents(commands: list[list[str]], env: dict[str, str] | list[dict[str, str]], log_paths: list[Path | None],
               timeout: float | None = None, cwd: str | None = None,
               while_waiting: Callable[[], None] | None = None, poll_s: float = 0.2,
               stopper: RunStopper | None = None, retry_if_port_taken: bool = False) -> tuple[list[int | None], bool]:
    """Start one process per command and wait for all: (return codes, timed out).

    ``env`` is every command's environment, or one per command. An agent's output goes to its log path, or
    to this process's stdout where that is
    None. ``while_waiting`` is called every ``poll_s`` seconds. With a ``stopper`` (:class:`RunStopper`),
    SIGTERM or SIGINT to this process stops the run (its ``signum`` says which came). Past ``timeout``, or
    however this ends, every agent is killed with all its workers (torchrun's own sessions included).
    ``retry_if_port_taken``: when the first agent (node 0, which hosts the store) ends because its master port
    was taken, stop every agent (the others would wait for it) and raise :class:`MasterPortTaken`.
    """
    stopper = stopper or RunStopper(handle_signals=False)
    envs = [{"OMP_NUM_THREADS": "1", **e} for e in (env if isinstance(env, list) else [env] * len(commands))]
    stopper.install()
    try:
        for cmd, path, env in zip(commands, log_paths, envs, strict=False):
            out = None if path is None else open(path, "w")
            # A session of its own per agent: a Ctrl-C at the terminal reaches this process only, which stops the run.
            stopper.agents.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                                   start_new_session=True, cwd=cwd))
            if out is not None:
                out.close()
        procs = stopper.agents
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs):
            if deadline is not None and time.monotonic() > deadline:
                return [proc.poll() for proc in procs], True
            _raise_if_port_taken(procs[0], log_paths[0], retry_if_port_taken)
            if while_waiting is not None:
                while_waiting()
            stopper.poll()
            time.sleep(poll_s)
        _raise_if_port_taken(procs[0], log_paths[0], retry_if_port_taken)
        return [proc.returncode for proc in procs], False
    finally:
        stopper.kill_all()
        stopper.restore()


def run_demo(script: str, args: list[str], *, repo_root: str) -> None:
    """An example's ``--demo``: ``script`` with ``args`` as 2 simulated nodes x 2 ranks on this machine, on the
    tiny demo model; exits with 0 when every node did. The model is built here first, once, not by four ranks at
    once; the ranks import this checkout's package (``repo_root`` on their PYTHONPATH)."""
    demo_model_path()
    result = run_simulated_nodes([os.path.abspath(script), *args], nnodes=2, nproc_per_node=2, timeout=600,
                                 env={"OMP_NUM_THREADS": "1", "PYTHONPATH": repo_root})
    sys.exit(0 if all(rc == 0 for rc in result.returncodes) else 1)
