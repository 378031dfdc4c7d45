"""Run a test worker as several simulated nodes and collect what each rank reported.

Workers live in tests/workers/ and write ``rank<N>.json`` through
``worker_common``; a time limit turns a hang into a failed test.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import preload
from launch_log import launch_group

from twinkle_strategy.train.launcher import AgentsResult, on_a_free_port, run_agents, run_simulated_nodes
from twinkle_strategy.train.torchrun import torchrun_command

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"


@dataclasses.dataclass
class LaunchResult:
    returncodes: list[int | None]
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


_launch_ids = itertools.count()


def launch_env(out_dir: Path) -> dict[str, str]:
    """What every launch adds to this process's environment for its ranks."""
    return {
        "OMP_NUM_THREADS": "1",
        "TWINKLE_TEST_OUT": str(out_dir),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def launch(worker: str, args: list[str], out_dir: Path, nnodes: int = 2, nproc_per_node: int | list[int] = 2,
           timeout: float = 300.0, env: dict[str, str] | None = None,
           node_env: list[dict[str, str]] | None = None, python: str | None = None,
           preloaded: bool = True, max_restarts: int = 0) -> LaunchResult:
    """``preloaded``: fork each rank from a fork server that imported torch and transformers already
    (tests/preload.py; off with TWINKLE_TEST_PRELOAD=0). Turn it off for a launch that reads its processes'
    memory. ``max_restarts``: rounds torchrun starts the workers again after one fails (one node only; the
    worker reads its round from ``TORCHELASTIC_RESTART_COUNT``): several short runs for the price of one launch.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**launch_env(out_dir), **(env or {})}
    command = [str(WORKERS / worker), *args]
    preload_log, agent_python = None, python
    if preloaded and preload.enabled():
        preload_log = Path(tempfile.gettempdir()) / f"twinkle-preload-{os.getpid()}-{next(_launch_ids)}.jsonl"
        command, full_env = preload.preloaded_command(
            command, {**os.environ, **full_env}, python or sys.executable, preload_log,
            server_env={**os.environ, **launch_env(out_dir)})
        if preload.agents_enabled():  # the agents fork too
            agent_python = preload.forking_python(python or sys.executable)
    shape = "+".join(map(str, nproc_per_node)) if isinstance(nproc_per_node, list) else f"{nnodes}x{nproc_per_node}"
    with launch_group(f"{worker} {shape}") as record:  # the launch table's row (tests/launch_log.py)
        record.preload_log = None if preload_log is None else str(preload_log)
        if max_restarts:
            assert nnodes == 1 and node_env is None, "restarts: one node"
            result = _restarting_node(command, nproc_per_node, max_restarts, timeout=timeout, env=full_env,
                                      log_dir=out_dir, python=agent_python)
        else:
            result = run_simulated_nodes(command, nnodes=nnodes, nproc_per_node=nproc_per_node, timeout=timeout,
                                         env=full_env, log_dir=out_dir, cwd=str(REPO), node_env=node_env,
                                         python=agent_python)
        if preload_log is not None:
            record.forked, record.fallbacks = preload.outcomes(preload_log)
            preload_log.unlink(missing_ok=True)
    logs = [p.read_text(errors="replace") for p in result.log_paths]
    return LaunchResult(result.returncodes, result.timed_out, logs, out_dir, result.seconds)


def _restarting_node(command: list[str], nproc: int, max_restarts: int, *, timeout: float, env: dict[str, str],
                     log_dir: Path, python: str | None) -> AgentsResult:
    """One node's torchrun that starts its workers again up to ``max_restarts`` times (torchrun_command's c10d
    rendezvous, as twinkle-sft's restarts use), its output in ``log_dir/node0.log``."""
    log_path = Path(log_dir) / "node0.log"
    start = time.monotonic()

    def run(port: int, retry_if_taken: bool) -> tuple[list[int | None], bool]:
        agent = torchrun_command(command, 1, 0, nproc, port, max_restarts=max_restarts, python=python)
        return run_agents([agent], {**os.environ, **env}, [log_path], timeout=timeout, cwd=str(REPO),
                          retry_if_port_taken=retry_if_taken)

    returncodes, timed_out = on_a_free_port(run)
    return AgentsResult(returncodes, timed_out, [log_path], time.monotonic() - start)
