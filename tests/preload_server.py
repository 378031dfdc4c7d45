"""A fork server for the test launches: rank processes forked from an interpreter that has imported torch already.

Start-up (importing torch, transformers, peft and twinkle_strategy: 5-8 s a process on 2 cores) is most of a test
launch's cost. This server imports them once, then forks one child per rank that tests/preload_client.py (the
program torchrun runs in place of the worker) asks for. The child takes the client's argv, cwd, environment and
stdin/stdout/stderr (passed over the unix socket), and runs the worker as ``__main__``. torchrun, its agents,
rendezvous, restarts and exit codes stay real: only the imports are shared.

    python -u tests/preload_server.py SOCKET_PATH      # prints "ready" once it listens (tests/preload_servers.py runs it)

The server stays single-threaded (a select loop over the listening socket, the clients and a SIGCHLD self-pipe) and
runs no compute, so a forked child has no thread or OpenMP pool that fork would leave broken. Only the standard
library is imported at the top: the same file serves other interpreters (the vLLM env's), whose packages differ.

Wire format: the client sends a 4-byte length with its three fds (SCM_RIGHTS), then that many bytes of JSON
``{"argv", "cwd", "env"}``. The server answers JSON lines: ``{"pid"}`` (forked) or ``{"fallback": reason}`` (run the
worker in a fresh interpreter instead), then ``{"exit": code}`` or ``{"signal": number}`` when the child ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
import threading

# What a typical worker imports (python -X importtime on tests/workers/*.py); a module this interpreter lacks is
# skipped. The model classes load lazily in transformers, so the tiny families' classes are imported by name.
PRELOAD = [
    "torch", "torch.nn.functional", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing.errors", "torch.utils.data",
    "numpy", "safetensors", "safetensors.torch", "yaml",
    "transformers", "transformers.modeling_utils", "transformers.trainer", "peft", "datasets", "trl",
    "twinkle_strategy", "twinkle_strategy.train.cli", "twinkle_strategy.train.trainer", "twinkle_strategy.testing",
    "twinkle_strategy.testing.tiny_models", "twinkle_strategy.testing.families",
    # ms-swift's rank program (swift/cli/sft.py), in its virtualenv (tests/swift_preload.py): 11 s of imports a rank
    "swift.cli.utils", "swift.ray_utils", "swift.pipelines",
]
MODEL_CLASSES = [
    "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM", "OlmoeForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
]

# Keys torchrun's agent sets per rank (torch/distributed/elastic/agent/server/local_elastic_agent.py,
# elastic/multiprocessing/api.py), pytest's and the project's TWINKLE_* variables (none is read at import time): these may
# differ between the server's environment and a rank's. Any other difference could change what a module read at
# import (huggingface_hub's HF_HOME, transformers' verbosity, tempfile's TMPDIR), so such a rank runs fresh.
PER_RANK_KEYS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "PYTHONPATH",
                 "PYTEST_CURRENT_TEST",  # pytest's, in the environment of whatever a test starts
                 "PYTHONHASHSEED",  # each of an interpreter's two servers has its own (tests/preload_servers.py)
                 # twinkle-sft sets it for a launch with restarts; torch's rendezvous reads it in the agent, when a
                 # round starts, never a rank at import (12 ranks of a full run started fresh for it alone)
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                 # ms-swift's launch settings: read by its launcher and by swift.utils.env's functions when called
                 "NPROC_PER_NODE", "NNODES", "NODE_RANK"}
# HCCL_* and FSDP_* are read when a process group is made or a model loaded, never at import; in-process tests leave
# them in pytest's environment (the library's HCCL defaults, TrainingArguments' FSDP_CPU_RAM_EFFICIENT_LOADING), and
# 56 ranks of a full run started fresh for that alone.
PER_RANK_PREFIXES = ("GROUP_", "ROLE_", "TORCHELASTIC_", "TWINKLE_", "HCCL_", "FSDP_")
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
    names = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    tasks = os.listdir("/proc/self/task")
    return names + ([f"{len(tasks) - 1} native thread(s)"] if len(tasks) > 1 else [])


def env_difference(env: dict[str, str], base: dict[str, str]) -> str | None:
    """The first key that differs between a rank's environment and the server's, other than the per-rank ones."""
    for key in sorted(set(env) | set(base)):
        if key in PER_RANK_KEYS or key.startswith(PER_RANK_PREFIXES) or env.get(key) == base.get(key):
            continue
        return f"{key} differs from the preloaded interpreter's"
    server_path = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    rank_path = env.get("PYTHONPATH", "").split(os.pathsep)
    if not set(server_path) <= set(rank_path):
        return "PYTHONPATH lacks an entry the preloaded interpreter imported from"
    return None


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
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        worker, module = become(request["argv"], request.get("executable"))
        import random

        random.seed()  # a fresh interpreter seeds from the OS; forked ones would share the server's state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:  # OpenMP read OMP_NUM_THREADS when the server loaded it
            sys.modules["torch"].set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        code = run_worker(worker, module=module)
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


def become(argv: list[str], executable: str | None) -> tuple[str, bool]:
    """Set sys.argv, sys.path and sys.executable as ``EXECUTABLE ARGV...`` would have them (``ARGV``: a script and its
    arguments, or ``-m MODULE ARGS``, as a torchrun agent's); returns the script (or module) and whether a module."""
    module = argv[1] if argv[0] == "-m" else None
    worker = module or os.path.abspath(argv[0])
    sys.argv = [worker, *argv[2 if module else 1:]]
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in entries]  # sys.path[0] was this server's folder
    sys.path[:] = [os.getcwd() if module else os.path.dirname(worker), *entries, *rest]
    if executable:  # a stand-in interpreter's (tests/preload_servers.py): what this process starts runs through it
        sys.executable = executable
    return worker, module is not None


def run_worker(worker: str, *, module: bool = False) -> int:
    """Run the worker (a script, or with ``module`` a module as ``python -m`` does) as a fresh interpreter would,
    including its end: the exit code, the traceback of an uncaught exception, non-daemon threads joined, atexit
    handlers run."""
    import atexit
    import importlib.util
    import runpy

    name = worker
    if module:  # the traceback of an uncaught exception starts at the module's own frame, as `python -m` prints it
        worker = importlib.util.find_spec(name).origin
    try:
        if module:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
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


class Server:
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
    """``preload_server.py --run EXECUTABLE ARGV...``: run ``ARGV`` in this fresh interpreter as ``EXECUTABLE`` (a
    stand-in's path, tests/preload_client.py) would: where a stand-in's program cannot fork, or must not (twinkle-sft's
    torchrun agents), it still starts what it starts through the stand-in."""
    worker, module = become(argv, executable)
    code = run_worker(worker, module=module)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    if sys.argv[1] == "--run":
        run_fresh(sys.argv[2], sys.argv[3:])
    path = sys.argv[1]
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
    server = Server(path, base_env)
    print(f"ready (skipped: {', '.join(skipped) or 'none'})", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
