"""Start a script as several torchrun agents on one machine: simulated nodes for demos and tests.

On a real cluster you run one ``torchrun --nnodes N --node_rank i ...`` per
node. Here every "node" is a torchrun agent on 127.0.0.1, so each rank sees
RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK exactly as it would there.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


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


def torchrun_command(script_and_args: list[str], nnodes: int, node_rank: int, nproc: int, port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node_rank", str(node_rank), "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
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
) -> AgentsResult:
    """Run ``script_and_args`` under ``nnodes`` torchrun agents and wait for all of them.

    With ``log_dir`` each agent's output goes to ``node{i}.log``; otherwise to
    this process's stdout. Past ``timeout`` seconds every agent and worker is killed.
    """
    per_node = nproc_per_node if isinstance(nproc_per_node, list) else [nproc_per_node] * nnodes
    port = free_port()
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    procs, log_paths = [], []
    start = time.monotonic()
    for node in range(nnodes):
        out = None
        path = None
        if log_dir is not None:
            path = Path(log_dir) / f"node{node}.log"
            out = open(path, "w")
        cmd = torchrun_command(script_and_args, nnodes, node, per_node[node], port)
        # A session of its own per agent, so a time-out can kill the agent with all its workers.
        procs.append(subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=True, cwd=cwd))
        if out is not None:
            out.close()
        log_paths.append(path)
    returncodes: list[int | None] = [None] * nnodes
    timed_out = False
    try:
        for i, proc in enumerate(procs):
            remaining = None if timeout is None else max(start + timeout - time.monotonic(), 0.1)
            returncodes[i] = proc.wait(timeout=remaining)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            elif returncodes[i] is None:
                returncodes[i] = proc.returncode
    return AgentsResult(returncodes, timed_out, log_paths, time.monotonic() - start)
