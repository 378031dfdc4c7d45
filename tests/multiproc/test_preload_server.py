"""The fork server of the test launches (tests/preload.py): a rank forked from it
ends as a real process would, in the eyes of torchrun and the tests. Each case runs the client as torchrun would
(``python -u preload.py WORKER ARGS``), with the environment a launch gives its ranks; the cases are one
launch in the launch table."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import preload
import pytest
from launch_log import launch_group
from multinode import REPO, WORKERS, launch_env

PROBE = str(WORKERS / "preload_probe.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Start a client per case; returns a function that starts one and the log of how each rank started."""
    root = tmp_path_factory.mktemp("preload")
    env = {**os.environ, **launch_env(root)}
    log = root / "preload.jsonl"
    _, client_env = preload.preloaded_command([], env, sys.executable, log, server_env=env)
    servers = [preload.server_for(sys.executable, env, slot=slot)
               for slot in range(preload.HASH_SEED_SLOTS)]
    for server in servers:
        assert server.problem is None, server.problem  # it also refuses to start while a thread besides main lives

    def start(mode: str, *, as_module: bool = False, python: str | None = None, module: str = "preload_probe",
              code: str | None = None, **extra_env) -> tuple[subprocess.Popen, Path]:
        """The probe through the client as torchrun starts a rank; ``as_module``: ``PYTHON -m MODULE`` with
        preload.forking_python as PYTHON (or ``python``), as multinode.launch starts a torchrun agent; ``code``:
        ``PYTHON -c CODE`` (the code in place of the probe)."""
        out = root / f"{mode}-{len(list(root.glob('*.json')))}.json"
        command = [python or preload.forking_python(sys.executable), "-m", module] if as_module else \
            [python or preload.forking_python(sys.executable), "-c", code] if code is not None else \
            [sys.executable, "-u", str(preload.SCRIPT), PROBE]
        proc = subprocess.Popen([*command, mode, str(out)], env={**client_env, "RANK": "3", **extra_env},
                                cwd=str(WORKERS if as_module else REPO), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        return proc, out

    with launch_group("preload.py client cases"):
        yield start, log, servers


def wait_for(path: Path, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)
    time.sleep(0.05)
    return json.loads(path.read_text())


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


def test_a_forked_rank_runs_the_worker_as_main_and_exits_with_its_code(ranks):
    start, log, servers = ranks
    proc, out = start("exit")
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert seen["preloaded"] and seen["ppid"] == servers[3 % 2].proc.pid and seen["pid"] != proc.pid, seen
    assert seen["argv"] == [PROBE, "exit", str(out)] and seen["cwd"] == str(REPO) and seen["rank"] == "3", seen
    assert seen["path0"] == str(WORKERS), seen
    assert {"pid": proc.pid, "rank": "3", "outcome": "forked", "child": seen["pid"]} in \
        map(json.loads, log.read_text().splitlines())


def test_the_stand_in_interpreter_forks_a_module_as_python_m_runs_it(ranks):
    """multinode.launch's torchrun agents: ``PYTHON -m torch.distributed.run ...``, PYTHON the stand-in."""
    start, log, servers = ranks
    proc, out = start("exit", as_module=True)
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert seen["preloaded"] and seen["ppid"] == servers[3 % 2].proc.pid, seen
    # as `python -m`: argv[0] the module's file, the current directory first on the path
    assert seen["argv"] == [PROBE, "exit", str(out)] and seen["path0"] == str(WORKERS), seen
    assert {"pid": proc.pid, "rank": "3", "outcome": "forked", "child": seen["pid"]} in \
        map(json.loads, log.read_text().splitlines())


def test_the_stand_in_interpreter_forks_python_c_as_python_runs_it(ranks):
    """``PYTHON -c CODE ARGS`` (a test's one-process helper in another virtualenv): forked, with python's argv, path
    and ``__main__``, its exit code, and an uncaught exception's traceback as python -c prints it."""
    start, log, _ = ranks
    code = ("import json, os, sys\n"
            "seen = {'preloaded': 'torch' in sys.modules, 'argv': sys.argv, 'path0': sys.path[0], 'pid': os.getpid(),\n"
            "        'main': __name__}\n"
            "json.dump(seen, open(sys.argv[2], 'w'))\n"
            "sys.exit(7) if sys.argv[1] == 'exit' else 1 / 0\n")
    proc, out = start("exit", code=code)
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert seen["preloaded"] and seen["pid"] != proc.pid and seen["main"] == "__main__", seen
    assert seen["argv"] == ["-c", "exit", str(out)] and seen["path0"] == "", seen
    assert {"pid": proc.pid, "rank": "3", "outcome": "forked", "child": seen["pid"]} in \
        map(json.loads, log.read_text().splitlines())
    proc, out = start("raise", code=code)
    assert proc.wait(timeout=60) == 1
    err = proc.stderr.read()
    assert err.startswith('Traceback (most recent call last):\n  File "<string>", line 5, in <module>'), err
    assert err.rstrip().endswith("ZeroDivisionError: division by zero"), err


def test_a_stand_in_with_programs_is_the_interpreter_of_what_it_runs_forked_or_fresh(ranks):
    """preload.cli_command's stand-in: a module of ``programs`` runs its script instead, forked, with the stand-in as
    its ``sys.executable`` (so that what it starts, twinkle-sft's agents and their ranks, runs through it too); a
    module of ``fresh`` runs in a fresh interpreter, with the stand-in as its ``sys.executable`` all the same."""
    start, log, servers = ranks
    stand_in = preload.forking_python(sys.executable, programs={"probe_alias": PROBE},
                                              fresh=("preload_probe",))
    proc, out = start("exit", as_module=True, python=stand_in, module="probe_alias")
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert seen["preloaded"] and seen["ppid"] == servers[3 % 2].proc.pid, seen
    assert seen["argv"] == [PROBE, "exit", str(out)] and seen["executable"] == stand_in, seen
    proc, out = start("exit", as_module=True, python=stand_in)
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert not seen["preloaded"] and seen["pid"] == proc.pid and seen["executable"] == stand_in, seen
    assert seen["argv"] == [PROBE, "exit", str(out)] and seen["path0"] == str(WORKERS), seen
    assert not [line for line in map(json.loads, log.read_text().splitlines()) if line["pid"] == proc.pid]  # no fallback
    proc, out = start("exit", as_module=True, python=stand_in, module="probe_alias",
                      TWINKLE_PRELOAD_FALLBACK="no server here")  # a fallback keeps the stand-in too
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert not seen["preloaded"] and seen["executable"] == stand_in and seen["argv"][0] == PROBE, seen


def test_neighbouring_ranks_hash_strings_with_different_seeds_as_real_ranks_do(ranks):
    # A rank inherits its server's PYTHONHASHSEED: even and odd ranks fork from two servers with seeds of their own,
    # so a set of strings walked in rank-dependent order (a hang on a real cluster) can show in the tests.
    start, _, servers = ranks
    seen = {}
    for rank in ("2", "3"):
        proc, out = start("exit", RANK=rank)
        assert proc.wait(timeout=60) == 7, proc.stderr.read()
        seen[rank] = json.loads(out.read_text())
    assert seen["2"]["ppid"] == servers[0].proc.pid and seen["3"]["ppid"] == servers[1].proc.pid, seen
    assert servers[0].hash_seed != servers[1].hash_seed
    assert seen["2"]["str_hash"] != seen["3"]["str_hash"], seen


def test_an_uncaught_exception_prints_the_workers_traceback_and_exits_1(ranks):
    start, _, _ = ranks
    proc, _ = start("raise")
    assert proc.wait(timeout=60) == 1
    err = proc.stderr.read()
    assert err.startswith("Traceback (most recent call last):\n  File \"" + PROBE), err  # no server/runpy frames
    assert err.rstrip().endswith("ValueError: the probe's own error"), err


def test_a_rank_killed_by_a_signal_reports_that_signal(ranks):
    start, _, _ = ranks
    proc, _ = start("self_kill")
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()


def test_sigterm_to_the_client_reaches_the_workers_handler(ranks):
    start, _, _ = ranks
    proc, out = start("wait_term")
    wait_for(out)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 5, proc.stderr.read()  # the worker's handler ran and chose the exit code
    assert json.loads(out.read_text())["got"] == signal.SIGTERM


def test_a_sigkilled_client_takes_its_child_with_it(ranks):
    start, _, _ = ranks
    proc, out = start("sleep")
    child = wait_for(out)["pid"]
    proc.kill()
    proc.wait(timeout=60)
    assert gone(child), f"rank pid {child} outlived its SIGKILLed client"


def test_a_sigkilled_client_takes_its_childs_own_processes_too(ranks):
    """A forked torchrun agent's ranks are its children: they go with it, as a fresh agent's go with its process
    group."""
    start, _, _ = ranks
    proc, out = start("with_child")
    seen = wait_for(out)
    proc.kill()
    proc.wait(timeout=60)
    assert gone(seen["pid"]) and gone(seen["grandchild"]), seen


def test_a_rank_with_a_tmpdir_of_its_own_is_forked_and_finds_its_temporary_folder_there(ranks, tmp_path):
    """The server's imports asked tempfile for its folder (dill keeps a copy, torch's caches derive theirs from it):
    a forked rank with another TMPDIR sees what a fresh interpreter with that TMPDIR sees."""
    start, log, _ = ranks
    seen = {}
    for how, extra in (("forked", {}), ("fresh", {preload.FALLBACK_ENV: "the fresh interpreter to compare with"})):
        proc, out = start("temp_dir", TMPDIR=str(tmp_path), **extra)
        assert proc.wait(timeout=120) == 7, proc.stderr.read()
        seen[how] = json.loads(out.read_text())
        assert seen[how]["preloaded"] == (how == "forked"), seen[how]
    for record in seen.values():
        assert record["temp_dir"] == record["dill_temp_dir"] == str(tmp_path), record
        assert os.path.dirname(record["made"]) == str(tmp_path), record
    assert seen["forked"]["dynamo_cache"] == seen["fresh"]["dynamo_cache"], seen
    assert "forked" in [json.loads(line)["outcome"] for line in log.read_text().splitlines()
                        if json.loads(line).get("child") == seen["forked"]["pid"]]


def test_a_rank_with_settings_of_a_library_the_server_never_imports_is_forked(ranks):
    """vLLM's VLLM_* settings: no server imports vllm, so a rank's own vllm reads them, forked or fresh."""
    start, log, _ = ranks
    assert "vllm" not in preload.PRELOAD
    proc, out = start("exit", VLLM_CPU_KVCACHE_SPACE="1")
    assert proc.wait(timeout=60) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert seen["preloaded"] and seen["pid"] != proc.pid, seen
    assert {"pid": proc.pid, "rank": "3", "outcome": "forked", "child": seen["pid"]} in \
        map(json.loads, log.read_text().splitlines())


def test_a_rank_whose_import_time_environment_differs_starts_fresh(ranks, tmp_path):
    start, log, _ = ranks
    proc, out = start("exit", HF_HOME=str(tmp_path / "hf"))
    assert proc.wait(timeout=120) == 7, proc.stderr.read()
    seen = json.loads(out.read_text())
    assert not seen["preloaded"] and seen["pid"] == proc.pid, seen  # exec'd in place: the client's own pid
    outcomes = [json.loads(line) for line in log.read_text().splitlines() if json.loads(line)["pid"] == proc.pid]
    assert [o["outcome"] for o in outcomes] == ["fallback: HF_HOME differs from the preloaded interpreter's"]
