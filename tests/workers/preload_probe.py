"""One rank's view of how it was started, for tests/multiproc/test_preload_server.py: whether it was forked from
the preloaded interpreter, its pid, parent, argv and cwd; then it ends the way ``--mode`` asks."""

import json
import os
import signal
import sys
import time

PRELOADED = "torch" in sys.modules  # before this script imports anything: only a fork of the server has it
MODE, OUT = sys.argv[1], sys.argv[2]


def record(**extra) -> None:
    with open(OUT, "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "preloaded": PRELOADED, "argv": sys.argv,
                   "cwd": os.getcwd(), "rank": os.environ.get("RANK"), "path0": sys.path[0], "executable": sys.executable,
                   "str_hash": hash("twinkle"), **extra}, f)


def on_term(signum, _frame):
    record(got=signum)
    sys.exit(5)


if MODE == "exit":
    record()
    sys.exit(7)
if MODE == "temp_dir":  # where this rank's temporary files go (a forked rank with its own TMPDIR: preload.redo_temp_dir)
    import tempfile

    import dill.session
    from torch._dynamo.package import DynamoCache

    record(temp_dir=tempfile.gettempdir(), made=tempfile.mkdtemp(), dill_temp_dir=str(dill.session.TEMPDIR),
           dynamo_cache=DynamoCache.path_prefix())
    sys.exit(7)
if MODE == "raise":
    record()
    raise ValueError("the probe's own error")
if MODE == "self_kill":
    record()
    os.kill(os.getpid(), signal.SIGKILL)
if MODE == "with_child":  # as a forked torchrun agent, whose ranks are its children
    import subprocess

    grandchild = subprocess.Popen(["sleep", "120"])
    record(grandchild=grandchild.pid)
    time.sleep(120)
if MODE == "wait_term":
    signal.signal(signal.SIGTERM, on_term)
if MODE in ("wait_term", "sleep"):
    record()
    time.sleep(120)
    sys.exit(9)  # not reached: the test signals or kills it first
