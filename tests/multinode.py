"""Run a worker script as several simulated nodes: one torchrun agent per node on 127.0.0.1.

Each rank then sees RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK exactly
as on a real cluster. A time limit kills every agent and worker, so a hang
fails the test instead of blocking CI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class LaunchResult:
    returncodes: list[int | None]  # one per node agent; None if killed at the time limit
    timed_out: bool
    logs: list[str]
    out_dir: Path
    seconds: float

    def rank_results(self) -> dict[int, dict]:
        """The JSON each rank wrote to its result file, by global rank."""
        results = {}
        for path in sorted(self.out_dir.glob("rank*.json")):
            data = json.loads(path.read_text())
            results[data["rank"]] = data
        return results

    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def describe(self) -> str:
        tail = "\n".join(f"--- node {i} ---\n{log[-6000:]}" for i, log in enumerate(self.logs))
        return f"returncodes={self.returncodes} timed_out={self.timed_out} seconds={self.seconds:.1f}\n{tail}"


def launch(
    worker: str,
    args: list[str],
    out_dir: Path,
    nnodes: int = 2,
    nproc_per_node: int | list[int] = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Start ``nnodes`` torchrun agents running ``tests/workers/<worker>`` and wait for all of them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_node = nproc_per_node if isinstance(nproc_per_node, list) else [nproc_per_node] * nnodes
    port = free_port()
    full_env = dict(os.environ)
    full_env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TWINKLE_TEST_OUT": str(out_dir),
            "PYTHONPATH": os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")]),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    full_env.update(env or {})
    procs, log_files = [], []
    start = time.monotonic()
    for node in range(nnodes):
        log_path = out_dir / f"node{node}.log"
        log_file = open(log_path, "w")
        log_files.append(log_path)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nnodes), "--node_rank", str(node),
            "--nproc_per_node", str(per_node[node]),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(WORKERS / worker), *args,
        ]
        procs.append(subprocess.Popen(cmd, env=full_env, stdout=log_file, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=str(REPO)))
        log_file.close()
    timed_out = False
    returncodes: list[int | None] = [None] * nnodes
    deadline = start + timeout
    for i, proc in enumerate(procs):
        remaining = deadline - time.monotonic()
        try:
            returncodes[i] = proc.wait(timeout=max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for i, proc in enumerate(procs):
            proc.wait()
            returncodes[i] = None if returncodes[i] is None else returncodes[i]
    logs = [p.read_text(errors="replace") for p in log_files]
    return LaunchResult(returncodes, timed_out, logs, out_dir, time.monotonic() - start)
