"""What torchrun runs as each rank when the suite preloads: ``python -u preload_client.py WORKER.py ARGS...``; and,
standing in for the interpreter itself, each torchrun agent of ``multinode.launch`` (``PYTHON -m torch.distributed.run
...``, PYTHON a script tests/preload_servers.py writes that calls :func:`main` with ``as_python``).

It asks the fork server (tests/preload_server.py, at ``$TWINKLE_PRELOAD_SOCKET``) for a child that runs the worker
with this process's argv, cwd, environment and stdin/stdout/stderr, then stands in for that child: signals sent to
this process go to the child, and this process ends as the child did (the same exit code, or killed by the same
signal), so torchrun and the tests see a rank that behaves as a real one. If this process is SIGKILLed, the server
sees its connection close and kills the child. Where the server is unreachable, or this rank's environment differs
from the server's in a key a module may have read at import, the worker runs in a fresh interpreter instead (exec),
and ``$TWINKLE_PRELOAD_LOG`` gets a line saying so (tests/launch_log.py counts them).

Only light standard modules are imported: this process's start-up is what the server saves.
"""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV, LOG_ENV = "TWINKLE_PRELOAD_SOCKET", "TWINKLE_PRELOAD_LOG"
FALLBACK_ENV = "TWINKLE_PRELOAD_FALLBACK"  # set by tests/preload_servers.py where no server can serve this launch
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def note(outcome: str, child: int | None = None) -> None:
    """One line per rank (or agent) in the launch's preload log: ``forked`` (with the forked ``child``'s pid, which
    the launch table's process count follows) or ``fallback: <why>``."""
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "outcome": outcome,
                                "child": child}) + "\n")


def fresh_interpreter(python_args: list[str], why: str | None, *, executable: str | None = None) -> None:
    """Run the command line in a fresh interpreter (``why``: the fallback's reason, noted; None: not a fallback).
    ``executable``: the ``sys.executable`` it is to have (a stand-in's path), which the server's ``--run`` mode sets
    before it runs the program as python would."""
    if why is not None:
        note(f"fallback: {why}")
    program = forkable(python_args)
    if executable and program:
        server = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload_server.py")
        os.execv(sys.executable, [sys.executable, "-u", server, "--run", executable, *program])
    os.execv(sys.executable, [sys.executable, *python_args])


def forkable(python_args: list[str]) -> list[str] | None:
    """What the server runs for a python command line: ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` (``-u``
    dropped: the server's output is unbuffered already); None for any other option, which a fresh interpreter
    handles."""
    args = list(python_args)
    while args[:1] == ["-u"]:
        args.pop(0)
    if (args[:1] == ["-m"] and len(args) >= 2) or (args and not args[0].startswith("-")):
        return args
    return None


def server_socket() -> str:
    """Even ranks fork from the first server, odd ranks from the second: each has its own string-hash seed, so
    neighbouring ranks iterate sets of strings in different orders, as ranks of a real run do."""
    sockets = os.environ[SOCKET_ENV].split(os.pathsep)
    return sockets[int(os.environ.get("RANK", "0")) % len(sockets)]


def main(argv: list[str] | None = None, *, as_python: bool = False, executable: str | None = None,
         programs: dict[str, str] | None = None, fresh: tuple[str, ...] = ()) -> None:
    """``argv``: the worker and its arguments (``sys.argv[1:]``); with ``as_python``, the arguments of a python
    command line, this process standing in for the interpreter (tests/preload_servers.py's ``forking_python``).

    A stand-in can also be an interpreter of its own: ``executable`` (its path) becomes the ``sys.executable`` of what
    it runs, so the processes those start (torchrun's agents and ranks) run through it too; ``programs`` maps a module
    to the script it runs instead (``-m twinkle_strategy.train.cli`` to the suite's rank program); the modules in
    ``fresh`` run in a fresh interpreter, never forked."""
    argv = sys.argv[1:] if argv is None else argv
    python_args = argv if as_python else ["-u", *argv]
    worker_argv = forkable(python_args)
    if worker_argv and worker_argv[0] == "-m" and worker_argv[1] in (programs or {}):
        worker_argv = python_args = [programs[worker_argv[1]], *worker_argv[2:]]
    pending: list[int] = []
    child = [0]

    def relay(sig, _frame):
        if child[0]:
            os.kill(child[0], sig)
        else:
            pending.append(sig)  # arrived before the server said which pid the child has

    for sig in RELAYED:
        signal.signal(sig, relay)
    if worker_argv is None:
        fresh_interpreter(python_args, f"python options the fork server does not take: {python_args[:3]}")
    if worker_argv[0] == "-m" and worker_argv[1] in fresh:
        fresh_interpreter(python_args, None, executable=executable)
    if os.environ.get(FALLBACK_ENV):
        fresh_interpreter(python_args, os.environ[FALLBACK_ENV], executable=executable)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(server_socket())
        request = {"argv": worker_argv, "cwd": os.getcwd(), "env": dict(os.environ)}
        request = json.dumps({**request, "executable": executable} if executable else request).encode()
        socket.send_fds(conn, [struct.pack("!I", len(request))], [0, 1, 2])
        conn.sendall(request)
        replies = conn.makefile("r")
        first = json.loads(replies.readline() or "{}")
    except (OSError, KeyError, ValueError) as exc:
        fresh_interpreter(python_args, f"no preload server ({type(exc).__name__}: {exc})", executable=executable)
        return
    if "pid" not in first:
        conn.close()
        fresh_interpreter(python_args, first.get("fallback", "the server refused"), executable=executable)
        return
    child[0] = first["pid"]
    note("forked", child[0])
    for sig in pending:
        os.kill(child[0], sig)
    line = replies.readline()  # blocks until the child ends; a relayed signal interrupts and resumes it
    status = json.loads(line) if line else {}
    sys.stdout.flush()
    if "signal" in status:
        for sig in RELAYED:
            signal.signal(sig, signal.SIG_DFL)
        if status["signal"] not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(status["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    if "exit" not in status:
        print(f"preload client: the fork server closed without the status of rank pid {child[0]}", file=sys.stderr,
              flush=True)
    os._exit(status.get("exit", 1))


if __name__ == "__main__":
    main()
