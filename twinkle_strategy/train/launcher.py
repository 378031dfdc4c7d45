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
import time
from collections.abc import Callable
from pathlib import Path

from twinkle_strategy.train.rank_logs import RUN_DIR_ENV, LogFollower, agent_log_path, failure_summary, logs_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class AgentsResult:
    returncodes: list[int | None]  # one per node agent; None where it was killed at the time limit
    timed_out: bool
    log_paths: list[Path | None]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def torchrun_command(script_and_args: list[str], nnodes: int, node_rank: int, nproc: int, port: int, *,
                     max_restarts: int = 0, master_addr: str = "127.0.0.1") -> list[str]:
    """One node's torchrun; ``max_restarts``: times torchrun restarts the workers after a failure (the
    trainer of a restarted worker resumes from its run's newest complete checkpoint).

    Restarts use the c10d rendezvous: when one node's workers fail, every node's agent sees the new
    rendezvous round and restarts its workers too. The static one (``--master_addr``) restarts each node
    on its own schedule, and the new workers of one node time out waiting for the others.
    """
    if max_restarts > 0:
        # torch's c10d rendezvous otherwise shares one TCP store with the workers of every round, so a
        # restarted round's default process group can read a dead worker's address left by the last one
        # ("Gloo connectFullMesh failed ... Connection refused"), which costs the restart and leaves the
        # other node waiting. torch's own switch gives every round a fresh worker store on a new port.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master_addr}:{port}", "--rdzv_id", f"twinkle-{port}",
                 "--max_restarts", str(max_restarts)]
    else:
        where = ["--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(port)]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--nproc_per_node", str(nproc), *where,
        *script_and_args,
    ]


def run_simulated_nodes(
    script_and_args: list[str],
    nnodes: int = 2,
    nproc_per_node: int | list[int] = 2,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    cwd: str | None = None,
    node_env: list[dict[str, str]] | None = None,
) -> AgentsResult:
    """Run ``script_and_args`` under ``nnodes`` torchrun agents and wait for all of them.

    With ``log_dir`` each agent's output goes to ``node{i}.log``; otherwise to
    this process's stdout. Past ``timeout`` seconds every agent and worker is killed.
    ``node_env[i]`` adds to node i's environment what differs between real nodes (e.g. a local disk).
    """
    per_node = nproc_per_node if isinstance(nproc_per_node, list) else [nproc_per_node] * nnodes
    port = free_port()
    commands = [torchrun_command(script_and_args, nnodes, node, per_node[node], port) for node in range(nnodes)]
    log_paths = [None if log_dir is None else Path(log_dir) / f"node{node}.log" for node in range(nnodes)]
    start = time.monotonic()
    env = {**os.environ, **(env or {})}
    envs = [{**env, **(node_env[node] if node_env else {})} for node in range(nnodes)]
    returncodes, timed_out = run_agents(commands, envs, log_paths, timeout=timeout, cwd=cwd)
    return AgentsResult(returncodes, timed_out, log_paths, time.monotonic() - start)


def run_logged(commands: list[list[str]], run_dir: str, ranks: list[int], node_ranks: list[int]) -> bool:
    """Run torchrun agents (``commands``, one per node) whose workers log to ``run_dir/logs``.

    The workers (``twinkle-sft``) find ``run_dir`` in ``TWINKLE_RUN_DIR``. The first of
    ``ranks`` is shown live on stderr; a failed run ends with one summary on stderr
    (:mod:`twinkle_strategy.train.rank_logs`). Returns whether every agent succeeded.
    """
    os.makedirs(logs_dir(run_dir), exist_ok=True)
    env = {**os.environ, RUN_DIR_ENV: run_dir, "PYTHONUNBUFFERED": "1"}
    follower = LogFollower(run_dir, ranks[0], sys.stderr.buffer)
    returncodes, _ = run_agents(commands, env, [Path(agent_log_path(run_dir, n)) for n in node_ranks],
                                while_waiting=follower.poll)
    follower.finish()
    if all(rc == 0 for rc in returncodes):
        return True
    print(failure_summary(run_dir, ranks, node_ranks), file=sys.stderr, flush=True)
    return False


def run_agents(commands: list[list[str]], env: dict[str, str] | list[dict[str, str]], log_paths: list[Path | None],
               timeout: float | None = None, cwd: str | None = None,
               while_waiting: Callable[[], None] | None = None, poll_s: float = 0.2) -> tuple[list[int | None], bool]:
    """Start one process per command and wait for all: (return codes, timed out).

    ``env`` is every command's environment, or one per command. An agent's output goes to its log path, or
    to this process's stdout where that is
    None. ``while_waiting`` is called every ``poll_s`` seconds. Past ``timeout``, or if
    this process is interrupted, every agent is killed with all its workers.
    """
    envs = [{"OMP_NUM_THREADS": "1", **e} for e in (env if isinstance(env, list) else [env] * len(commands))]
    procs = []
    for cmd, path, env in zip(commands, log_paths, envs, strict=False):
        out = None if path is None else open(path, "w")
        # A session of its own per agent, so it can be killed with all its workers.
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=True, cwd=cwd))
        if out is not None:
            out.close()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs):
            if deadline is not None and time.monotonic() > deadline:
                return [proc.poll() for proc in procs], True
            if while_waiting is not None:
                while_waiting()
            time.sleep(poll_s)
        return [proc.returncode for proc in procs], False
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
