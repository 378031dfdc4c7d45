"""Per-rank logs of a multi-process run, and the one summary a failed run ends with.

Left to torchrun, a run that fails on 4 ranks prints 4 interleaved tracebacks and then
torchrun's own error blocks, and the one line that matters is lost among them. Instead:

* each rank's stdout and stderr go to ``<run dir>/logs/rank{R}.log`` (one file per rank,
  as torchrun's ``--log-dir``; the two streams interleaved as a terminal shows them);
  torchrun's own output goes to ``logs/torchrun-node{N}.log``;
* the terminal shows one rank's log live (as torchrun's ``--tee`` with
  ``--local-ranks-filter``) up to its fatal traceback;
* a failed run ends with :func:`failure_summary`: each distinct error once with the ranks
  that raised it, the causes first (the ranks that stopped only because a peer failed, in one
  line after them), the traceback of the first cause, and where the logs are.

Worker side: :func:`capture_rank_output` and :func:`record_error`. Launcher side:
:class:`LogFollower` and :func:`failure_summary`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
import traceback
from typing import BinaryIO

from twinkle_strategy.distributed.fatal_errors import stopped_by_peer

RUN_DIR_ENV = "TWINKLE_RUN_DIR"  # the run directory a launcher chose for its workers
# A traceback's first line; torch.distributed's excepthook prefixes each line with "[rank<R>]: ".
TRACEBACK_START = re.compile(rb"(\[rank\d+\]: )?Traceback \(most recent call last\)")
AGENT_LOG_TAIL_LINES = 20
# A rank log's header line, "rank R of W (node N, local rank L), pid P: command" (capture_rank_output): one per
# attempt, since a restarted rank appends to its log.
HEADER = re.compile(rb"^rank \d+ of \S+ \(.*?\), pid (\d+):", re.M)


def logs_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "logs")


def rank_log_path(run_dir: str, rank: int) -> str:
    return os.path.join(logs_dir(run_dir), f"rank{rank}.log")


def agent_log_path(run_dir: str, node_rank: int) -> str:
    return os.path.join(logs_dir(run_dir), f"torchrun-node{node_rank}.log")


def _error_record_path(run_dir: str, rank: int) -> str:
    return os.path.join(logs_dir(run_dir), f"rank{rank}.error.json")


# ----------------------------------------------------------------------------- worker side
def capture_rank_output(run_dir: str, rank: int) -> None:
    """Send this process's stdout and stderr to its rank log.

    The file descriptors are redirected, not just ``sys.stdout``: output of C++ code
    (gloo, NCCL) and the traceback the interpreter prints on its way out land there too.
    """
    os.makedirs(logs_dir(run_dir), exist_ok=True)
    fd = os.open(rank_log_path(run_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # a live view and a complete log even if the rank is killed
    env = os.environ
    print(f"rank {rank} of {env.get('WORLD_SIZE', '?')} (node {env.get('GROUP_RANK', '?')}, local rank "
          f"{env.get('LOCAL_RANK', '?')}), pid {os.getpid()}: {' '.join(sys.argv)}", flush=True)


def record_error(run_dir: str, rank: int, exc: BaseException) -> None:
    """Write what the failure summary needs about ``exc``; call before the traceback is printed."""
    record = {"rank": rank, "type": type(exc).__name__, "message": str(exc),
              "traceback": "".join(traceback.format_exception(exc)), "time": time.time(),
              "after_peer": stopped_by_peer(exc, rank), "pid": os.getpid()}
    path = _error_record_path(run_dir, rank)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # whole or absent: the launcher may read it at any moment


# --------------------------------------------------------------------------- launcher side
class LogFollower:
    """Copies one rank's log to ``out`` as it grows, until the rank's fatal traceback.

    That traceback is left to the failure summary, which shows it once. A traceback the
    rank prints and survives (no error record yet) is copied like any other output. The
    log's first line, which rank and process wrote it, is left out: the launcher has just
    said whose output follows.
    """

    def __init__(self, run_dir: str, rank: int, out: BinaryIO):
        self.path = rank_log_path(run_dir, rank)
        self.error_record = _error_record_path(run_dir, rank)
        self.out = out
        self.offset = 0
        self.pending = b""
        self.stopped = False
        self.header_seen = False
        self.mid_line = False  # the last piece shown ended without '\n' (a progress bar's '\r')
        self.pid: int | None = None  # of the attempt being followed, from its header line

    def _fatal_error_recorded(self) -> bool:
        """This attempt's process recorded its fatal error (not an earlier attempt's, before a restart)."""
        if not os.path.exists(self.error_record):
            return False
        with open(self.error_record) as f:
            pid = json.load(f).get("pid")
        return pid is None or self.pid is None or pid == self.pid

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        # Whole lines only, where a progress bar's '\r' also ends a line.
        *complete, self.pending = re.split(rb"(?<=[\r\n])", self.pending + data)
        for piece in complete:
            if header := HEADER.match(piece):
                self.pid = int(header.group(1))
                if self.header_seen:  # torchrun restarted the ranks (launch.max_restarts): follow the new attempt
                    self.stopped = False
                    self.out.write(b"\n" if self.mid_line else b"")
                    self.mid_line = False
                    self.out.write(b"twinkle-sft: torchrun restarted the ranks; the new attempt's output follows\n")
                self.header_seen = True
                continue
            if self.stopped:
                continue
            if TRACEBACK_START.match(piece) and self._fatal_error_recorded():
                self.stopped = True  # left to the failure summary, unless a restarted attempt follows
                continue
            self.out.write(piece)
            self.mid_line = not piece.endswith(b"\n")
        self.out.flush()

    def end_line(self) -> None:
        """End a line left open (a progress bar), so that what the launcher prints next has a line of its own."""
        if self.mid_line:
            self.out.write(b"\n")
            self.out.flush()
            self.mid_line = False

    def finish(self) -> None:
        self.poll()
        if not self.stopped and self.pending:
            self.out.write(self.pending + b"\n")
            self.out.flush()


@dataclasses.dataclass
class ErrorRecord:
    rank: int
    type: str
    message: str
    traceback: str
    time: float
    after_peer: bool = False  # the rank failed because another did (its collective lost the peer, or an abort)
    pid: int | None = None  # the process that raised: tells an earlier attempt's record from the latest one's


def read_error_records(run_dir: str, ranks: list[int]) -> dict[int, ErrorRecord]:
    """The errors the ranks of the latest attempt raised. After a torchrun restart (``launch.max_restarts``) a
    record the rank's earlier process left is not this attempt's error: it is told apart by its pid."""
    records = {}
    for rank in ranks:
        path = _error_record_path(run_dir, rank)
        if os.path.exists(path):
            with open(path) as f:
                record = ErrorRecord(**json.load(f))
            latest = latest_rank_pid(run_dir, rank)
            if record.pid is None or latest is None or record.pid == latest:
                records[rank] = record
    return records


def latest_rank_pid(run_dir: str, rank: int) -> int | None:
    """The pid of the rank's latest process, from the newest header line in its log (one per attempt)."""
    path = rank_log_path(run_dir, rank)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        found = HEADER.findall(f.read())
    return int(found[-1]) if found else None


# torchrun's report of a worker ended by SIGKILL (the kernel's out-of-memory killer sends it).
_SIGKILLED = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)")
# torch's TCPStore when the master port was taken between the check before launch and torchrun's bind.
_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use")
_STORE_PORT = re.compile(r"port: (\d+)")


def _agent_logs_text(run_dir: str, node_ranks: list[int]) -> str:
    texts = []
    for node in node_ranks:
        path = agent_log_path(run_dir, node)
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                texts.append(f.read())
    return "\n".join(texts)


def port_taken_line(run_dir: str, node_ranks: list[int]) -> str | None:
    """One line when torchrun could not bind the master port (taken after the check made before launch)."""
    text = _agent_logs_text(run_dir, node_ranks)
    if _PORT_TAKEN.search(text) is None:
        return None
    port = _STORE_PORT.search(next(line for line in text.splitlines() if _PORT_TAKEN.search(line)))
    which = f"master port {port.group(1)}" if port else "the master port"
    return (f"twinkle-sft: torchrun could not listen on {which}: another process took it after the check made "
            f"before launch (address already in use); run the command again, or pick a free port with "
            f"MASTER_PORT=<port>; torchrun's output: {os.path.join(logs_dir(run_dir), 'torchrun-node<N>.log')}")


def failure_summary(run_dir: str, ranks: list[int], node_ranks: list[int]) -> str:
    """Each distinct error once with the ranks that raised it, the first failing rank's traceback,
    and where every rank's log is. A clear cause no rank could record (the master port taken) is one line;
    out of memory is named only where torchrun reports a SIGKILL."""
    records = read_error_records(run_dir, ranks)
    if not records and (port_line := port_taken_line(run_dir, node_ranks)):
        return port_line
    killed = bool(_SIGKILLED.search(_agent_logs_text(run_dir, node_ranks)))
    lines = []
    if records:
        lines.append(f"twinkle-sft: the run failed; {len(records)} of {len(ranks)} ranks raised an error:")
        causes = [r for r in records.values() if not r.after_peer]
        lines.extend(_grouped(causes or list(records.values())))
        after_peer = sorted(r.rank for r in records.values() if r.after_peer)
        if causes and after_peer:  # their messages name the cause above, after their own connection errors
            kinds = sorted({records[rank].type for rank in after_peer})
            lines.append(f"  rank(s) {after_peer} stopped because of the error(s) above ({', '.join(kinds)}; see their logs)")
        silent = [rank for rank in ranks if rank not in records]
        if silent:
            why = ("killed by SIGKILL (out of memory?), or stopped by torchrun after another rank failed" if killed
                   else "stopped by torchrun after another rank failed")
            lines.append(f"  rank(s) {silent} raised nothing: {why}; see their logs")
        first = min(causes or records.values(), key=lambda r: r.time)
        lines.append(f"Traceback of rank {first.rank}, the first to fail:")
        lines.append(first.traceback.rstrip())
    else:
        why = ("torchrun reports a rank killed by SIGKILL: out of memory, or a kill -9" if killed
               else "it stopped before the ranks started, or they were killed")
        lines.append(f"twinkle-sft: the run failed and no rank recorded a Python error ({why}). The end of "
                     "torchrun's output:")
        for node in node_ranks:
            lines.extend(_tail(agent_log_path(run_dir, node), AGENT_LOG_TAIL_LINES))
    logs = logs_dir(run_dir)
    lines.append(f"Every rank's full output: {os.path.join(logs, 'rank<R>.log')} "
                 f"(ranks {ranks[0]}-{ranks[-1]}); torchrun's own: {os.path.join(logs, 'torchrun-node<N>.log')}")
    return "\n".join(lines)


def _grouped(records: list[ErrorRecord]) -> list[str]:
    """Each distinct error once, with the ranks that raised it, the earliest first."""
    by_error: dict[tuple[str, str], list[ErrorRecord]] = {}
    for record in sorted(records, key=lambda r: r.time):
        by_error.setdefault((record.type, record.message), []).append(record)
    lines = []
    for (kind, message), raised in by_error.items():
        lines.append(f"  {kind}: {message}")
        lines.append(f"    raised on rank(s) {sorted(r.rank for r in raised)}")
    return lines


def _tail(path: str, count: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return ["  " + line.rstrip("\n") for line in f.readlines()[-count:]]
