"""The suite's fork machinery: test ranks (and torchrun agents) forked from interpreters that imported torch already.

Importing torch, transformers, peft and twinkle_strategy costs a process 5-8 s on 2 cores, most of a test launch.
So one fork server per interpreter (``.venv``'s, ms-swift's, vLLM's) imports them once, and each rank is a fork of
it. torchrun, its agents, rendezvous, restarts and exit codes stay real: only the imports are shared. This one file
is all of it, run three ways, and imports only the standard library at the top (the other virtualenvs run it too,
and a client's start-up is what the server saves):

    python -u tests/preload.py WORKER.py ARGS...            # the client: what torchrun runs as each rank
    python -u tests/preload.py --serve SOCKET_PATH          # a fork server (server_for starts it)
    python -u tests/preload.py --run EXECUTABLE ARGV...     # a stand-in's program, in a fresh interpreter

Sections, top to bottom:
1. The rule: which environment keys a forked rank may have different from its server's (``env_difference``).
2. The server: a single-threaded select loop (the listening socket, its clients, a SIGCHLD self-pipe) that runs no
   compute, so a forked child has no thread or OpenMP pool that fork would leave broken. Wire format: the client
   sends a 4-byte length with its three stdio fds (SCM_RIGHTS), then that much JSON ``{"argv", "cwd", "env"}``; the
   server answers JSON lines, ``{"pid"}`` (forked) or ``{"fallback": reason}``, then ``{"exit": code}`` or
   ``{"signal": number}`` when the child ends.
3. The client: asks a server for a child that runs the worker with its argv, cwd, environment and stdio, relays
   signals to it and ends as it did; a SIGKILLed client's child is killed by the server. Where no server can serve
   it, or the rule says no, the worker runs in a fresh interpreter (exec) and ``$TWINKLE_PRELOAD_LOG`` says why.
4. The pytest side: two servers per interpreter, started on first use and ended with the session; the command and
   environment ``multinode.launch`` gives torchrun; the stand-in interpreter (``forking_python``) that forks
   torchrun's agents too; the outcomes the launch table counts (tests/launch_log.py).
5. The two front ends whose launchers build their ranks' commands themselves: ``twinkle-sft`` (``cli_env``,
   ``cli_command``) and ``swift sft`` (``swift_command``).

``TWINKLE_TEST_PRELOAD=0`` turns it all off; ``TWINKLE_TEST_PRELOAD_AGENTS=0`` only the agents' forks;
``launch(..., preloaded=False)`` one launch. docs/testing.md describes it.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import signal
import socket
import struct
import sys

SCRIPT = os.path.abspath(__file__)
HERE = os.path.dirname(SCRIPT)  # tests/


# ---- 1. The rule: what a forked rank's environment may differ in -----------------------------------------------------

# Keys torchrun's agent sets per rank (torch/distributed/elastic/agent/server/local_elastic_agent.py,
# elastic/multiprocessing/api.py), pytest's and the project's TWINKLE_* variables (none is read at import time): these may
# differ between the server's environment and a rank's. Any other difference could change what a module read at
# import (huggingface_hub's HF_HOME, transformers' verbosity), so such a rank runs fresh; TMPDIR's the child redoes.
PER_RANK_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "PYTHONPATH",
                 "PYTEST_CURRENT_TEST",  # pytest's, in the environment of whatever a test starts
                 "PYTHONHASHSEED",  # each of an interpreter's two servers has its own (section 4)
                 # twinkle-sft sets it for a launch with restarts; torch's rendezvous reads it in the agent, when a
                 # round starts, never a rank at import (12 ranks of a full run started fresh for it alone)
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                 # ms-swift's launch settings: read by its launcher and by swift.utils.env's functions when called
                 "NPROC_PER_NODE", "NNODES", "NODE_RANK"}
# HCCL_* and FSDP_* are read when a process group is made or a model loaded, never at import; in-process tests leave
# them in pytest's environment (the library's HCCL defaults, TrainingArguments' FSDP_CPU_RAM_EFFICIENT_LOADING), and
# 56 ranks of a full run started fresh for that alone.
PER_RANK_PREFIXES = ("GROUP_", "ROLE_", "TORCHELASTIC_", "TWINKLE_", "HCCL_", "FSDP_")
# TMPDIR is read at import, but through tempfile alone, which the child can ask again (redo_temp_dir): a launch that
# puts its ranks' tracebacks in a folder of their own (test_fatal_errors.py's 2x1) started its processes fresh for it.
REDONE_IN_CHILD_KEYS = {"TMPDIR"}
# vLLM's settings are read by vllm, which no server imports (PRELOAD): a forked rank's vllm reads its own, as a fresh
# one's would (test_grpo_colocate.py's ranks started fresh for VLLM_CPU_KVCACHE_SPACE). Only while vllm is not
# imported in the process that checks: the server, before it forks.
UNIMPORTED_LIBRARY_PREFIXES = {"VLLM_": "vllm"}

def read_only_after_fork(key: str) -> bool:
    """Whether ``key`` belongs to a library this process has not imported (UNIMPORTED_LIBRARY_PREFIXES)."""
    return any(key.startswith(prefix) and module not in sys.modules
               for prefix, module in UNIMPORTED_LIBRARY_PREFIXES.items())


def env_difference(env: dict[str, str], base: dict[str, str]) -> str | None:
    """The first key that differs between a rank's environment and the server's, other than the per-rank ones."""
    for key in sorted(set(env) | set(base)):
        if key in PER_RANK_KEYS or key in REDONE_IN_CHILD_KEYS or key.startswith(PER_RANK_PREFIXES) \
                or env.get(key) == base.get(key) or read_only_after_fork(key):
            continue
        return f"{key} differs from the preloaded interpreter's"
    server_path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    rank_path = env.get("PYTHONPATH", "").split(os.pathsep)
    if not set(server_path) <= set(rank_path):
        return "PYTHONPATH lacks an entry the preloaded interpreter imported from"
    return None


# ---- 2. The server ---------------------------------------------------------------------------------------------------

# What a typical worker imports (python -X importtime on tests/workers/*.py); a module this interpreter lacks is
# skipped. The model classes load lazily in transformers, so the tiny families' classes are imported by name.
PRELOAD = [
    "torch", "torch.nn.functional", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing.errors", "torch.utils.data",
    "numpy", "safetensors", "safetensors.torch", "yaml",
    "transformers", "transformers.modeling_utils", "transformers.trainer", "peft", "datasets", "trl",
    "twinkle_strategy", "twinkle_strategy.train.cli", "twinkle_strategy.train.trainer", "twinkle_strategy.testing",
    "twinkle_strategy.testing.tiny_models", "twinkle_strategy.testing.families",
    # ms-swift's rank program (swift/cli/sft.py), in its virtualenv (swift_command): 11 s of imports a rank
    "swift.cli.utils", "swift.ray_utils", "swift.pipelines",
]
MODEL_CLASSES = [
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM", "OlmoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
]

PLAIN_SIGNAL_DEFAULTS = {signal.SIGPIPE: signal.SIG_IGN, signal.SIGXFSZ: signal.SIG_IGN}  # as Python starts up


def preload() -> list[str]:
    """Import what the workers import; returns what was skipped (not installed here, or failing to import)."""
    import importlib

    skipped = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - another interpreter may lack it; the worker imports it then
            skipped.append(f"{name} ({type(exc).__name__})")
    if "transformers" in sys.modules:
        import transformers

        for name in MODEL_CLASSES:
            try:
                getattr(transformers, name)
            except Exception:  # noqa: BLE001
                skipped.append(name)
    return skipped


def threads_alive() -> list[str]:
    """Threads besides the main one: fork copies only the calling thread, so any other would be broken in a child."""
    import threading

    names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = os.listdir("/proc/self/task")
    return names + ([f"{len(tasks) - 1} native thread(s)"] if len(tasks) > 1 else [])


def run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the rank process the client would have started, run the worker, exit. Never returns."""
    code = 1
    try:
        os.setsid()  # as torchrun's start_new_session: the rank leads its own process group
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        temp_dir_before = os.environ.get("TMPDIR")
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if os.environ.get("TMPDIR") != temp_dir_before:
            redo_temp_dir()
        worker, kind = become(request["argv"], request.get("executable"))
        import random

        random.seed()  # a fresh interpreter seeds from the OS; forked ones would share the server's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:  # OpenMP read OMP_NUM_THREADS when the server loaded it
            sys.modules["torch"].set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        code = run_worker(worker, kind=kind)
    except BaseException:  # noqa: BLE001 - the setup itself failed: say so where the rank's output goes
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def redo_temp_dir() -> None:
    """The temporary folder as a fresh interpreter with this process's TMPDIR would have it. tempfile caches its
    folder on first use, and the server's imports used it; of what they derived from it, dill.session keeps a copy
    (``TEMPDIR``), while torch's inductor and dynamo caches ask tempfile again (the cleared environment has no
    ``TORCHINDUCTOR_CACHE_DIR`` left). tests/multiproc/test_preload_server.py checks each against a fresh
    interpreter's."""
    import tempfile

    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    if "dill.session" in sys.modules:
        import pathlib

        sys.modules["dill.session"].TEMPDIR = pathlib.PurePath(tempfile.gettempdir())


def become(argv: list[str], executable: str | None) -> tuple[str, str]:
    """Set sys.argv, sys.path and sys.executable as ``EXECUTABLE ARGV...`` would have them (``ARGV``: a script and its
    arguments, ``-m MODULE ARGS`` as a torchrun agent's, or ``-c CODE ARGS``); returns the script (the module, the
    code) and which of ``script``, ``module`` and ``code`` it is."""
    kind = {"-m": "module", "-c": "code"}.get(argv[0], "script")
    worker = os.path.abspath(argv[0]) if kind == "script" else argv[1]
    sys.argv = [worker if kind != "code" else "-c", *argv[1 if kind == "script" else 2:]]
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in entries]  # sys.path[0] was this server's folder
    first = {"module": os.getcwd(), "code": "", "script": os.path.dirname(worker)}[kind]  # as python puts it
    sys.path[:] = [first, *entries, *rest]
    if executable:  # a stand-in interpreter's (forking_python): what this process starts runs through it
        sys.executable = executable
    return worker, kind


def run_worker(worker: str, *, kind: str = "script") -> int:
    """Run the worker (a script; a module as ``python -m`` does; code as ``python -c`` does) as a fresh interpreter
    would, including its end: the exit code, the traceback of an uncaught exception, non-daemon threads joined,
    atexit handlers run."""
    import atexit
    import importlib.util
    import runpy
    import threading

    name = worker
    if kind == "module":  # the traceback of an uncaught exception starts at the module's own frame, as `python -m`
        worker = importlib.util.find_spec(name).origin
    elif kind == "code":
        worker = "<string>"
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        elif kind == "code":
            import types

            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(name, "<string>", "exec"), main.__dict__)  # noqa: S102 - what `python -c` runs
        else:
            runpy.run_path(worker, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except KeyboardInterrupt:  # Python ends by SIGINT then, so the parent sees the signal
        report_uncaught(worker)
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001
        report_uncaught(worker)
        code = 1
    threading._shutdown()  # joins non-daemon threads, as interpreter shutdown does
    atexit._run_exitfuncs()
    if code < 0:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def report_uncaught(worker: str) -> None:
    """The traceback a fresh interpreter prints: from the worker's frame on, without this server's and runpy's."""
    kind, value, tb = sys.exc_info()
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename != worker:
        tb = tb.tb_next
    sys.excepthook(kind, value.with_traceback(tb), tb)  # the default hook prints value.__traceback__


def reset_signals() -> None:
    """The child starts with the signal dispositions of a fresh Python process, not the server's."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, PLAIN_SIGNAL_DEFAULTS.get(sig, signal.SIG_DFL))
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    found, stack = [], list(children.get(pid, ()))
    while stack:
        found.append(stack.pop())
        stack.extend(children.get(found[-1], ()))
    return found


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, 4, 3)
    if len(header) < 4:
        raise ConnectionError("the client closed before its request")
    (size,) = struct.unpack("!I", header)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed mid-request")
        data += chunk
    return json.loads(data), list(fds)


def say(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # the client is gone; its child is killed when the server reads its end


class ForkServer:
    """The select loop: accept a client, fork its rank, tell the client how that rank ended."""

    def __init__(self, path: str, base_env: dict[str, str]):
        self.base_env = base_env
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.path = path
        self.wakeup_r, self.wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(self.wakeup_w, False)
        self.children: dict[int, socket.socket] = {}  # child pid -> its client's connection
        self.stopping = False

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.stop)
        try:
            while not self.stopping:
                conns = list(self.children.values())
                readable, _, _ = select.select([self.listener, self.wakeup_r, *conns], [], [])
                if self.wakeup_r in readable:
                    while True:
                        try:
                            if not os.read(self.wakeup_r, 512):
                                break
                        except BlockingIOError:
                            break
                    self.reap()
                if self.listener in readable:
                    self.accept()
                for conn in conns:
                    if conn in readable:
                        self.client_readable(conn)
        finally:
            for pid in self.children:
                self.kill(pid)
            os.unlink(self.path)

    def stop(self, *_):
        self.stopping = True

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        fds = []
        try:
            request, fds = receive(conn)
            why = env_difference(request["env"], self.base_env)
            if why or len(fds) != 3:
                say(conn, {"fallback": why or "no stdio passed"})
                conn.close()
                return
            pid = os.fork()
            if pid == 0:
                self.listener.close()
                for other in self.children.values():
                    other.close()
                conn.close()
                os.close(self.wakeup_r)
                os.close(self.wakeup_w)
                reset_signals()
                run_child(request, fds)
            conn.settimeout(None)
            self.children[pid] = conn
            say(conn, {"pid": pid})
        except (OSError, ValueError, KeyError, ConnectionError) as exc:
            print(f"preload server: a request failed: {exc!r}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def client_readable(self, conn: socket.socket) -> None:
        """A client only ever closes its end (it relays signals itself): its process died, so its child goes too."""
        try:
            if conn.recv(64):
                return
        except OSError:
            pass
        for pid, other in list(self.children.items()):
            if other is conn:
                self.kill(pid)

    def kill(self, pid: int) -> None:
        """SIGKILL the child and every process under it: a forked torchrun agent's ranks' clients would otherwise
        outlive it (a fresh agent's die with its process group, which the launcher kills)."""
        for victim in [pid, *descendants(pid)]:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if os.WIFSIGNALED(status):
                say(conn, {"signal": os.WTERMSIG(status)})
            else:
                say(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def run_fresh(executable: str, argv: list[str]) -> None:
    """``preload.py --run EXECUTABLE ARGV...``: run ``ARGV`` in this fresh interpreter as ``EXECUTABLE`` (a
    stand-in's path) would: where a stand-in's program cannot fork, or must not (twinkle-sft's
    torchrun agents), it still starts what it starts through the stand-in."""
    worker, kind = become(argv, executable)
    code = run_worker(worker, kind=kind)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(path: str) -> None:
    """``preload.py --serve SOCKET_PATH``: import, then print "ready" (or "not ready: why") and serve until SIGTERM."""
    base_env = dict(os.environ)  # before any import could change it: the ranks' environments are compared to this
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: the server ends with the pytest process
    except Exception:  # noqa: BLE001
        pass
    # pyarrow (datasets, trl) links a jemalloc that otherwise starts a purging thread at load; a rank forked from
    # here purges on allocation instead. Set in this process only: the ranks' environments stay theirs.
    os.environ["JE_ARROW_MALLOC_CONF"] = "background_thread:false"
    skipped = preload()
    threads = threads_alive()
    if threads:
        print(f"not ready: threads alive after the imports: {threads}", flush=True)
        sys.exit(3)
    server = ForkServer(path, base_env)
    print(f"ready (skipped: {', '.join(skipped) or 'none'})", flush=True)
    server.serve()


# ---- 3. The client ---------------------------------------------------------------------------------------------------

SOCKET_ENV, LOG_ENV = "TWINKLE_PRELOAD_SOCKET", "TWINKLE_PRELOAD_LOG"
FALLBACK_ENV = "TWINKLE_PRELOAD_FALLBACK"  # set by preloaded_command where no server can serve this launch
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
        os.execv(sys.executable, [sys.executable, "-u", SCRIPT, "--run", executable, *program])
    os.execv(sys.executable, [sys.executable, *python_args])


def forkable(python_args: list[str]) -> list[str] | None:
    """What the server runs for a python command line: ``[SCRIPT, ARGS...]``, ``["-m", MODULE, ARGS...]`` or ``["-c",
    CODE, ARGS...]`` (``-u`` dropped: the server's output is unbuffered already); None for any other option, which
    a fresh interpreter handles."""
    args = list(python_args)
    while args[:1] == ["-u"]:
        args.pop(0)
    if (args[:1] in (["-m"], ["-c"]) and len(args) >= 2) or (args and not args[0].startswith("-")):
        return args
    return None


def server_socket() -> str:
    """Even ranks fork from the first server, odd ranks from the second: each has its own string-hash seed, so
    neighbouring ranks iterate sets of strings in different orders, as ranks of a real run do."""
    sockets = os.environ[SOCKET_ENV].split(os.pathsep)
    return sockets[int(os.environ.get("RANK", "0")) % len(sockets)]


def client(argv: list[str] | None = None, *, as_python: bool = False, executable: str | None = None,
           programs: dict[str, str] | None = None, fresh: tuple[str, ...] = ()) -> None:
    """``argv``: the worker and its arguments (``sys.argv[1:]``); with ``as_python``, the arguments of a python
    command line, this process standing in for the interpreter (:func:`forking_python`).

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


# ---- 4. The pytest side: the servers, the launch command, the stand-in interpreter, the outcomes ---------------------
# Every interpreter gets TWO servers, each started with its own random PYTHONHASHSEED; even ranks fork from one, odd
# ranks from the other (server_socket). A fork inherits its server's string-hash seed: with one server every rank
# would iterate a set of strings in the same order, and a bug where ranks walk such a set in different orders
# (mismatched collectives, a hang on a real cluster, where every rank's seed differs) could never show here.

SWITCH_ENV, AGENTS_SWITCH_ENV = "TWINKLE_TEST_PRELOAD", "TWINKLE_TEST_PRELOAD_AGENTS"
READY_TIMEOUT_S = 300.0
HASH_SEED_SLOTS = 2  # servers per interpreter, each with its own string-hash seed


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0"


def agents_enabled() -> bool:
    """Whether multinode.launch's torchrun agents fork too (:func:`forking_python`); off with
    ``TWINKLE_TEST_PRELOAD_AGENTS=0`` (the ranks still fork)."""
    return enabled() and os.environ.get(AGENTS_SWITCH_ENV, "1") != "0"


class RunningServer:
    """A fork server this pytest process started (a plain class: the client imports this module, and dataclasses
    would cost each rank's start-up the import of inspect)."""

    def __init__(self, *, python: str, socket_path: str, proc, problem: str | None, hash_seed: str):
        self.python = python
        self.socket = socket_path
        self.proc = proc  # its Popen; None where it did not start
        self.problem = problem  # why it did not start (its ranks fall back to a fresh interpreter, and say so)
        self.hash_seed = hash_seed  # its PYTHONHASHSEED, which every rank it forks inherits


_servers: dict[tuple[str, int], RunningServer] = {}
_interpreters: dict[tuple, int] = {}  # (interpreter, its options) -> the number of its stand-in (forking_python)
_root: list[str] = []


def _root_dir() -> str:
    if not _root:  # a short path: a unix socket's is limited to 107 bytes
        import atexit
        import tempfile

        _root.append(tempfile.mkdtemp(prefix="twpre-", dir="/tmp"))
        atexit.register(stop_all)
    return _root[0]


def server_for(python: str, env: dict[str, str], *, slot: int = 0) -> RunningServer:
    """The fork server ``slot`` of ``python``, started with ``env`` (the ranks' environment, less torchrun's per-rank
    keys) and a random string-hash seed of its own on first use, and waited for until its imports are done."""
    import random

    from launch_log import REAL_POPEN  # not at the top: the other interpreters run this file without tests/'s modules

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
    proc = REAL_POPEN([python, "-u", SCRIPT, "--serve", sock], env=env, stdout=-1, stderr=stderr, stdin=-3,
                      start_new_session=True, cwd=os.path.dirname(HERE))
    problem = _wait_ready(proc)
    if problem:
        stop(proc)
        proc = None
    server = _servers[(python, slot)] = RunningServer(python=python, socket_path=sock, proc=proc, problem=problem,
                                                      hash_seed=hash_seed)
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
    import shutil

    for server in _servers.values():
        if server.proc is not None:
            stop(server.proc)
    _servers.clear()
    if _root:
        shutil.rmtree(_root.pop(), ignore_errors=True)


def preloaded_command(script_and_args: list[str], env: dict[str, str], python: str, log_path, *,
                      server_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment (``env``, the ranks') for torchrun: the client in place of the worker, told where
    the server is, and ``log_path`` for its outcome. ``server_env``: what every launch's ranks have (a launch's own
    extras make its ranks fall back)."""
    command = [SCRIPT, *script_and_args]
    why = env_difference(env, server_env)  # a launch's own env= extras: no server is started for them
    if why is None:
        servers = [server_for(python, server_env, slot=slot) for slot in range(HASH_SEED_SLOTS)]
        broken = next((server for server in servers if server.proc is None), None)
        if broken is None:  # the client picks a socket by its RANK (server_socket)
            sockets = os.pathsep.join(server.socket for server in servers)
            return command, {**env, SOCKET_ENV: sockets, LOG_ENV: str(log_path)}
        why = broken.problem
    return command, {**env, FALLBACK_ENV: why, LOG_ENV: str(log_path)}


def forking_python(python: str, *, programs: dict[str, str] | None = None, fresh: tuple[str, ...] = (),
                   interpreter: bool = False) -> str:
    """An executable that stands in for ``python`` in a torchrun agent's command line (``PYTHON -m
    torch.distributed.run ...``, which multinode.launch has the product's launcher run): the agent is forked from
    ``python``'s fork server like a rank (:func:`client` with ``as_python``), instead of importing torch itself
    (about 2 s of CPU an agent, two agents a launch). torchrun in the agent starts its ranks with the real
    interpreter (its ``sys.executable``), through the client as before. Without a server: the real interpreter.

    With ``interpreter``, or ``programs`` (a module -> the script to run instead), the stand-in is an interpreter of
    its own: it is the ``sys.executable`` of what it runs, so whatever that starts with ``sys.executable``
    (twinkle-sft's and ms-swift's agents, and their ranks) runs through it too; the modules in ``fresh`` run in a
    fresh interpreter (:func:`cli_command`)."""
    key = (python, tuple(sorted((programs or {}).items())), tuple(fresh), interpreter or bool(programs))
    stand_in = os.path.join(_root_dir(), f"python-{_interpreters.setdefault(key, len(_interpreters))}", "python")
    if not os.path.exists(stand_in):
        os.mkdir(os.path.dirname(stand_in))
        options = f"executable={stand_in!r}, programs={programs or {}!r}, fresh={tuple(fresh)!r}" \
            if programs or interpreter else ""
        with open(stand_in, "w") as f:  # -S: no site-packages to scan; the client imports only the standard library
            f.write(f"#!{python} -S\nimport sys\nsys.path.insert(0, {HERE!r})\nimport preload\n"
                    f"preload.client(sys.argv[1:], as_python=True{', ' + options if options else ''})\n")
        os.chmod(stand_in, 0o755)
    return stand_in


def outcomes(log_path) -> tuple[int, list[str]]:
    """How many ranks were forked, and why each other one ran in a fresh interpreter."""
    forked, fallbacks = 0, []
    if os.path.exists(log_path):
        with open(log_path) as f:
            for line in f.read().splitlines():
                outcome = json.loads(line)["outcome"]
                if outcome == "forked":
                    forked += 1
                else:
                    fallbacks.append(outcome.removeprefix("fallback: "))
    return forked, fallbacks


# ---- 5. The front ends that build their ranks' commands themselves: twinkle-sft and swift sft ------------------------
# twinkle-sft runs ``torchrun ... -m twinkle_strategy.train.cli ARGS`` with the launcher's sys.executable, which
# torchrun's agents use for their ranks in turn, and the package has no seam for the tests. So the launcher runs under
# a stand-in interpreter with ``programs``: the launcher forks, with the stand-in for its sys.executable; its torchrun
# agents start fresh (its signal and restart tests are about them), still as the stand-in; each rank forks and runs
# tests/workers/twinkle_sft_rank.py (the CLI's main with the hooks a test asks for) in place of the CLI module.
#
# ms-swift's console script (``swift.cli.main.cli_main``) runs ``sys.executable -m torch.distributed.run ...
# swift/cli/sft.py ARGS`` (each rank imports its pipeline, about 11 s). So ``python -m swift.cli.main`` runs under a
# stand-in interpreter that is its own sys.executable: the launcher, its torchrun agent and each rank fork (the
# launcher and the agent imported ms-swift's CLI and torch fresh for each launch before, about 5 s of CPU). ms-swift's
# argument handling, its torchrun command and torchrun itself stay as a user runs them.

RANK_PROGRAMS = {"twinkle_strategy.train.cli": os.path.join(HERE, "workers", "twinkle_sft_rank.py")}
FRESH_MODULES = ("torch.distributed.run",)  # twinkle-sft's torchrun agents
_log_ids = itertools.count()


def _front_end_log(kind: str):
    import tempfile
    from pathlib import Path

    return Path(tempfile.gettempdir()) / f"twinkle-preload-{kind}-{os.getpid()}-{next(_log_ids)}.jsonl"


def cli_env(env: dict[str, str], *, python: str = sys.executable) -> dict[str, str]:
    """``env`` for a ``twinkle-sft`` process, with its ranks forked from the preload servers; ``env`` as it is where
    preloading is off (the stand-in runs everything fresh then). The ranks get what every ``multinode.launch`` rank
    gets (``launch_env``), so they match the servers' environment."""
    import tempfile
    from pathlib import Path

    from multinode import launch_env  # not at the top: multinode imports this module

    if not enabled():
        return env
    every_rank = launch_env(Path(tempfile.gettempdir()))
    env = {**env, **{k: v for k, v in every_rank.items() if k != "TWINKLE_TEST_OUT"}}
    _, env = preloaded_command([], env, python, _front_end_log("cli"), server_env={**os.environ, **every_rank})
    return env


def cli_command(env: dict[str, str], *, python: str = sys.executable) -> list[str]:
    """``python -m twinkle_strategy.train.cli`` under the stand-in interpreter, for a process with :func:`cli_env`'s
    ``env``."""
    return [forking_python(python, programs=RANK_PROGRAMS, fresh=FRESH_MODULES), "-m", "twinkle_strategy.train.cli"]


def swift_command(swift_bin, env: dict[str, str], *, log=None) -> tuple[list[str], dict[str, str], object]:
    """The command that stands for ms-swift's ``swift`` (``sft`` and its arguments follow it), ``env`` for it, and the
    preload log the launch table reads (None: preloading is off and the command is ms-swift's console script;
    ``log``: one to share, a launch's other node's). The servers are those of ms-swift's virtualenv, which
    ``multinode.launch(python=...)`` uses too."""
    import tempfile
    from pathlib import Path

    from multinode import launch_env

    if not enabled():
        return [str(Path(swift_bin) / "swift")], env, None
    log, python = log or _front_end_log("swift"), str(Path(swift_bin) / "python")
    server_env = {**os.environ, **launch_env(Path(tempfile.gettempdir()))}
    _, env = preloaded_command([], env, python, log, server_env=server_env)
    return [forking_python(python, interpreter=True), "-m", "swift.cli.main"], env, log


def forked_python(python: str, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``python``'s stand-in for a test's one-process helper (a script, ``-m`` or ``-c`` code): forked from that
    interpreter's servers like a rank (they imported torch, transformers, peft and, in ms-swift's virtualenv, ms-swift:
    seconds a helper), and ``env`` for it, with what every launch's ranks have so that it matches the servers'. Where
    preloading is off: ``python`` and ``env`` as they are."""
    import tempfile
    from pathlib import Path

    from multinode import launch_env

    if not enabled():
        return python, env
    every_rank = {k: v for k, v in launch_env(Path(tempfile.gettempdir())).items() if k != "TWINKLE_TEST_OUT"}
    _, env = preloaded_command([], {**every_rank, **env}, python, _front_end_log("helper"),
                               server_env={**os.environ, **launch_env(Path(tempfile.gettempdir()))})
    return forking_python(python), env


def swift_python(swift_bin, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """:func:`forked_python` for ms-swift's virtualenv (``swift_bin``: its bin folder)."""
    return forked_python(os.path.join(str(swift_bin), "python"), env)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "--run":
        run_fresh(sys.argv[2], sys.argv[3:])
    else:
        client()
