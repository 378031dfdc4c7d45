"""The pytest side of the preloaded launches: one fork server per interpreter, started on first use, ended with
the session; what ``multinode.launch`` runs in place of the worker.

Each rank of a ``multinode.launch`` otherwise spends 5-8 s importing torch, transformers and peft; with the fork
server (tests/preload_server.py) that happens once per pytest session and interpreter, and each rank is a fork
(tests/preload_client.py). ``TWINKLE_TEST_PRELOAD=0`` turns it off; ``launch(..., preloaded=False)`` turns it off for
one launch (one that measures a process's memory: a forked child's RSS counts the pages it shares with the server).

Every interpreter gets TWO servers, each started with its own random ``PYTHONHASHSEED``, and even ranks fork from one,
odd ranks from the other. A fork inherits its server's string-hash seed; with one server every rank would iterate a
set of strings in the same order, and a bug where ranks walk such a set in different orders (mismatched collectives,
a hang on a real cluster, where every rank's seed differs) could never show here.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import select
import shutil
import signal
import tempfile
from pathlib import Path

from launch_log import REAL_POPEN
from preload_client import FALLBACK_ENV, LOG_ENV, SOCKET_ENV
from preload_server import env_difference

HERE = Path(__file__).resolve().parent
SERVER, CLIENT = HERE / "preload_server.py", HERE / "preload_client.py"
SWITCH_ENV = "TWINKLE_TEST_PRELOAD"
AGENTS_SWITCH_ENV = "TWINKLE_TEST_PRELOAD_AGENTS"
READY_TIMEOUT_S = 300.0


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def agents_enabled() -> bool:
    """Whether multinode.launch's torchrun agents fork too (:func:`forking_python`); off with
    ``TWINKLE_TEST_PRELOAD_AGENTS=0`` (the ranks still fork)."""
    return enabled() and os.environ.get(AGENTS_SWITCH_ENV, "1") != "0"


@dataclasses.dataclass
class Server:
    python: str
    socket: str
    proc: object | None  # the server's Popen; None where it did not start
    problem: str | None  # why it did not start (its ranks fall back to a fresh interpreter, and say so)
    hash_seed: str  # its PYTHONHASHSEED, which every rank it forks inherits


HASH_SEED_SLOTS = 2  # servers per interpreter, each with its own string-hash seed (see the module's docstring)
_servers: dict[tuple[str, int], Server] = {}
_interpreters: dict[tuple, int] = {}  # (interpreter, its options) -> the number of its stand-in (forking_python)
_root: list[str] = []


def _root_dir() -> str:
    if not _root:  # a short path: a unix socket's is limited to 107 bytes
        _root.append(tempfile.mkdtemp(prefix="twpre-", dir="/tmp"))
        atexit.register(stop_all)
    return _root[0]


def server_for(python: str, env: dict[str, str], *, slot: int = 0) -> Server:
    """The fork server ``slot`` of ``python``, started with ``env`` (the ranks' environment, less torchrun's per-rank
    keys) and a random string-hash seed of its own on first use, and waited for until its imports are done."""
    if (python, slot) in _servers:
        return _servers[(python, slot)]
    taken = {server.hash_seed for (py, _), server in _servers.items() if py == python}
    hash_seed = next(seed for seed in iter(lambda: str(random.randrange(1, 2**32)), None) if seed not in taken)
    env = {**env, "PYTHONHASHSEED": hash_seed}
    root = _root_dir()
    sock = os.path.join(root, f"s{len(_servers)}.sock")
    stderr = open(os.path.join(root, f"s{len(_servers)}.log"), "w")  # noqa: SIM115 - the server keeps it
    # REAL_POPEN: the server is no launch of a test (tests/launch_log.py); its own session, so a terminal's Ctrl-C
    # reaches the ranks through their clients, not the server.
    proc = REAL_POPEN([python, "-u", str(SERVER), sock], env=env, stdout=-1, stderr=stderr, stdin=-3,
                      start_new_session=True, cwd=str(HERE.parent))
    problem = _wait_ready(proc)
    if problem:
        stop(proc)
        proc = None
    server = _servers[(python, slot)] = Server(python, sock, proc, problem, hash_seed)
    return server


def _wait_ready(proc) -> str | None:
    """None once the server listens; otherwise what it said instead."""
    seen = []
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
        if line.startswith("ready"):
            return None
        if line:
            seen.append(line)
        if not ready or not line or line.startswith("not ready"):
            if proc.poll() is None and not ready:
                return f"the preload server was not ready in {READY_TIMEOUT_S:.0f} s"
            return f"the preload server did not start: {' | '.join(seen[-3:]) or f'exit {proc.poll()}'}"


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # it kills its live children, then exits
        try:
            proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            proc.kill()
            proc.wait()


def stop_all() -> None:
    for server in _servers.values():
        if server.proc is not None:
            stop(server.proc)
    _servers.clear()
    if _root:
        shutil.rmtree(_root.pop(), ignore_errors=True)


def preloaded_command(script_and_args: list[str], env: dict[str, str], python: str, log_path: Path, *,
                      server_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment (``env``, the ranks') for torchrun: the client in place of the worker, told where
    the server is. ``server_env``: what every launch's ranks have (a launch's own extras make its ranks fall back)."""
    command = [str(CLIENT), *script_and_args]
    why = env_difference(env, server_env)  # a launch's own env= extras: no server is started for them
    if why is None:
        servers = [server_for(python, server_env, slot=slot) for slot in range(HASH_SEED_SLOTS)]
        broken = next((server for server in servers if server.proc is None), None)
        if broken is None:  # the client picks a socket by its RANK (tests/preload_client.py)
            sockets = os.pathsep.join(server.socket for server in servers)
            return command, {**env, SOCKET_ENV: sockets, LOG_ENV: str(log_path)}
        why = broken.problem
    return command, {**env, FALLBACK_ENV: why, LOG_ENV: str(log_path)}


def forking_python(python: str, *, programs: dict[str, str] | None = None, fresh: tuple[str, ...] = ()) -> str:
    """An executable that stands in for ``python`` in a torchrun agent's command line (``PYTHON -m
    torch.distributed.run ...``, which multinode.launch has the product's launcher run): the agent is forked from
    ``python``'s fork server like a rank (tests/preload_client.py, ``as_python``), instead of importing torch itself
    (about 2 s of CPU an agent, two agents a launch). torchrun in the agent starts its ranks with the real
    interpreter (its ``sys.executable``), through the client as before. Without a server: the real interpreter.

    With ``programs`` (a module -> the script to run instead) the stand-in is an interpreter of its own: it is the
    ``sys.executable`` of what it runs, so whatever that starts with ``sys.executable`` (twinkle-sft's agents, and
    their ranks) runs through it too; the modules in ``fresh`` run in a fresh interpreter (tests/cli_preload.py)."""
    key = (python, tuple(sorted((programs or {}).items())), tuple(fresh))
    stand_in = Path(_root_dir()) / f"python-{_interpreters.setdefault(key, len(_interpreters))}" / "python"
    if not stand_in.exists():
        stand_in.parent.mkdir()
        options = f"executable={str(stand_in)!r}, programs={programs!r}, fresh={tuple(fresh)!r}" if programs else ""
        # -S: no site-packages to scan; the client imports only the standard library
        stand_in.write_text(f"#!{python} -S\nimport sys\nsys.path.insert(0, {str(HERE)!r})\nimport preload_client\n"
                            f"preload_client.main(sys.argv[1:], as_python=True{', ' + options if options else ''})\n")
        stand_in.chmod(0o755)
    return str(stand_in)


def outcomes(log_path: Path) -> tuple[int, list[str]]:
    """How many ranks were forked, and why each other one ran in a fresh interpreter."""
    forked, fallbacks = 0, []
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            outcome = json.loads(line)["outcome"]
            if outcome == "forked":
                forked += 1
            else:
                fallbacks.append(outcome.removeprefix("fallback: "))
    return forked, fallbacks
