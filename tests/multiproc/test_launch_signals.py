"""twinkle-sft owns the processes it starts and never waits in silence (issue 31, points 1 and 2).

A 2-node recipe started on one machine says what it waits for; SIGINT or SIGTERM ends torchrun and every
rank and frees the master port; a master port in use or a missing device is one line before launch.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from multinode import REPO

from twinkle_strategy.train import cli
from twinkle_strategy.train.launcher import alive, descendants, device_problem, free_port, port_in_use, run_agents

DEMO = str(REPO / "yaml" / "demo.yaml")


class Cli:
    """``twinkle-sft`` in a session of its own, its stderr collected as it comes; ``stop()`` kills whatever is left."""

    def __init__(self, args, env, cwd):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
        self.proc = subprocess.Popen([sys.executable, "-m", "twinkle_strategy.train.cli", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.err, self.out = bytearray(), bytearray()
        self.seen: dict[int, str] = {}  # every process of the run ever seen: pid -> start time
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stderr, self.err), (self.proc.stdout, self.out))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, into):
        while chunk := os.read(stream.fileno(), 65536):
            into.extend(chunk)

    @property
    def stderr(self) -> str:
        return self.err.decode(errors="replace")

    def wait_for(self, text: str, timeout: float) -> float:
        """Seconds until ``text`` appeared on stderr (fails past ``timeout``), noting the run's processes meanwhile."""
        start = time.monotonic()
        while text not in self.stderr:
            self.seen.update(descendants([self.proc.pid]))
            assert self.proc.poll() is None, f"twinkle-sft ended (rc {self.proc.returncode}):\n{self.stderr}"
            assert time.monotonic() - start < timeout, f"no {text!r} in {timeout} s:\n{self.stderr}"
            time.sleep(0.2)
        self.seen.update(descendants([self.proc.pid]))
        return time.monotonic() - start

    def stop(self):
        self.seen.update(descendants([self.proc.pid]))
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in alive(self.seen):
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)


def _gone_within(run: Cli, seconds: float) -> list[int]:
    """The run's processes still alive ``seconds`` after the signal (twinkle-sft itself included)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (run.proc.poll() is None or alive(run.seen)):
        time.sleep(0.2)
    return ([run.proc.pid] if run.proc.poll() is None else []) + alive(run.seen)


def test_a_two_node_recipe_on_one_machine_says_what_it_waits_for_and_stops_on_sigint(tmp_path):
    """The waiting line within 10 s, then again every TWINKLE_WAITING_EVERY_S (60 s unless set; 2 s here)."""
    port = free_port()
    run = Cli([DEMO, "launch.simulated_nodes=false", "launch.nproc_per_node=1", f"train.output_dir={tmp_path}"],
              {"NNODES": "2", "NODE_RANK": "0", "MASTER_PORT": str(port), "TWINKLE_WAITING_EVERY_S": "2"}, cwd=REPO)
    try:
        run.wait_for("torchrun, 1 ranks on this node", timeout=240)
        assert run.wait_for("is waiting for node(s) 1", timeout=10) < 10
        deadline = time.monotonic() + 20
        while run.stderr.count("is waiting for node(s) 1") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.stderr.count("is waiting for node(s) 1") >= 3, run.stderr  # said, then repeated twice
        line = next(x for x in run.stderr.splitlines() if "is waiting for" in x)
        assert "NODE_RANK=1" in line and f"MASTER_PORT={port}" in line and "MASTER_ADDR=" in line, line
        assert "on the other node" in line, line
        # The waiting line is ours, printed on a timer from the launch; torchrun's agent opens its store on its own
        # schedule, which a loaded machine delays (helpers saw it late twice): give it until the waiting ends.
        listening_by = time.monotonic() + 60
        while not port_in_use(port) and time.monotonic() < listening_by:
            time.sleep(0.2)
        assert port_in_use(port), "torchrun's store should be listening while it waits"
        assert run.seen, "torchrun should be running"
        run.proc.send_signal(signal.SIGINT)
        assert _gone_within(run, 30) == [], run.stderr
        assert run.proc.returncode == 130, run.stderr
        assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr, run.stderr
        after = [x for x in run.stderr.rsplit("(Ctrl-C stops this one)", 1)[1].splitlines() if x.strip()]
        assert len(after) == 1 and after[0].startswith("twinkle-sft: stopped by SIGINT; every process of the run "
                                                       "has ended; last checkpoint: none saved (logs in "), run.stderr
        assert not port_in_use(port)
    finally:
        run.stop()


def _stop_during_training(output_dir: Path, env: dict[str, str], sig: signal.Signals) -> None:
    """Start a run of 2 ranks, send ``sig`` to twinkle-sft once it trains: every process ends within 30 s, the
    ranks save a checkpoint of their last step, and the terminal gets one line after the signal, naming it."""
    run = Cli([DEMO, "launch.simulated_nodes=false", "launch.nnodes=1", "train.max_steps=100000",
               "train.save_steps=100000", "train.logging_steps=1", f"train.output_dir={output_dir}"], env, cwd=REPO)
    try:
        run.wait_for("Train:", timeout=300)
        time.sleep(2)  # a few steps
        ranks = [pid for pid, _ in run.seen.items() if b"twinkle_strategy.train.cli" in Path(f"/proc/{pid}/cmdline")
                 .read_bytes() and pid != run.proc.pid]
        assert len(ranks) >= 2, "torchrun and its ranks should be running"
        shown = len(run.err)
        run.proc.send_signal(sig)
        assert _gone_within(run, 30) == [], run.stderr
    finally:
        run.stop()
    assert run.proc.returncode == 128 + sig, run.stderr  # a shell's status for a command ended by a signal
    (run_dir,) = [p for p in output_dir.iterdir() if p.name.startswith("v")]
    checkpoint = str(run_dir / "checkpoint-")
    # One line after the signal (a progress bar left mid-line is ended first): no rank output, no traceback.
    after = [x for x in re.split(r"[\r\n]", run.err[shown:].decode(errors="replace")) if x.strip()]
    assert after[-1].startswith(f"twinkle-sft: stopped by {sig.name}; every process of the run has ended; last "
                                f"checkpoint: {checkpoint}"), run.stderr[-3000:]
    # Before it, at most the step the terminal was showing as the signal came (its bar, its metrics).
    assert all(x.startswith(("Train:", "{'loss'")) for x in after[:-1]), after
    assert "Traceback" not in run.stderr and run.out.decode() == "", run.stderr[-3000:]
    saved = after[-1].split("last checkpoint: ")[1].split(" (logs in ")[0]
    assert os.path.isdir(saved), saved
    # What the ranks said while saving is in their logs, off the terminal.
    assert "saving a checkpoint at the end of this step" in (run_dir / "logs" / "rank0.log").read_text()
    assert "saving a checkpoint at the end of this step" not in run.stderr


def test_sigterm_during_training_checkpoints_ends_every_process_and_frees_the_port(tmp_path):
    """SIGTERM, then the next run on the same port starts and trains, and Ctrl-C (SIGINT) stops it the same way."""
    port = free_port()
    env = {"NNODES": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": str(port)}
    _stop_during_training(tmp_path / "a", env, signal.SIGTERM)
    assert not port_in_use(port)
    _stop_during_training(tmp_path / "b", env, signal.SIGINT)
    assert not port_in_use(port)


def test_a_master_port_in_use_is_one_line_before_launch(tmp_path, monkeypatch, capsys):
    """Through the CLI's main, in this process: the port is checked before torchrun starts, so no launch is needed."""
    monkeypatch.chdir(REPO)  # where tiny://demo is built, as twinkle-sft run from the repository builds it
    for name, value in {"OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        code = cli.main([DEMO, "launch.simulated_nodes=false", "launch.nnodes=1", f"train.output_dir={tmp_path / 'out'}"])
    stderr = capsys.readouterr().err
    lines = [x for x in stderr.splitlines() if x.startswith("twinkle-sft")]
    assert code == 2, stderr
    assert len(lines) == 1 and f"master port {port} is in use" in lines[0] and "MASTER_PORT=" in lines[0], stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists(), "nothing is written"


@pytest.mark.parametrize("option", ["strategy.device_type=cuda", "strategy.backend=nccl"])
def test_a_missing_cuda_device_is_one_line_before_launch(option, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main([DEMO, option, "strategy.mixed_precision=no", f"train.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs a CUDA GPU" in err[0] and "--device_type cpu" in err[0], err
    assert not (tmp_path / "out").exists()


def test_device_problem_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem("cpu") is None and device_problem(None) is None and device_problem(None, "gloo") is None
    assert "CUDA GPU" in device_problem("cuda")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "torch_npu is not installed" in device_problem("npu") and "NPU" in device_problem(None, "hccl")


def test_a_timed_out_launch_kills_workers_in_sessions_of_their_own(tmp_path):
    # torchrun starts each worker in a session of its own: killing the agent's process group misses them.
    pid_file = tmp_path / "worker.pid"
    agent = ("import subprocess, sys, time\n"
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
             f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
             "time.sleep(600)\n")
    worker = None
    try:
        codes, timed_out = run_agents([[sys.executable, "-c", agent]], dict(os.environ), [None], timeout=5)
        assert timed_out and codes == [None]
        worker = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _running(worker):
            time.sleep(0.1)
        assert not _running(worker), "the worker outlived its agent"
    finally:
        if worker is not None and _running(worker):
            os.kill(worker, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_failure_no_rank_recorded_is_named_by_its_cause(tmp_path, capsys):
    """The master port taken between the check before launch and torchrun's bind (a race the check cannot
    close) is one line, not torchrun's 30-line traceback under an "out of memory?" heading; out of memory is
    named only for a rank torchrun saw killed by SIGKILL."""
    from twinkle_strategy.train.launcher import run_logged, torchrun_command

    scripts = {"exit": "import sys; sys.exit(3)\n", "sigkill": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n"}
    for name, text in scripts.items():
        (tmp_path / f"{name}.py").write_text(text)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not run_logged([torchrun_command([str(tmp_path / "exit.py")], 1, 0, 1, port)], str(tmp_path / "race"),
                              [0], [0])
    err = capsys.readouterr().err
    assert err == (f"twinkle-sft: torchrun could not listen on master port {port}: another process took it after the "
                   "check made before launch (address already in use); run the command again, or pick a free port "
                   f"with MASTER_PORT=<port>; torchrun's output: {tmp_path}/race/logs/torchrun-node<N>.log\n"), err
    headings = {}
    for name in scripts:
        assert not run_logged([torchrun_command([str(tmp_path / f"{name}.py")], 1, 0, 1, free_port())],
                              str(tmp_path / name), [0], [0])
        headings[name] = capsys.readouterr().err.splitlines()[0]
    assert "out of memory" not in headings["exit"] and "killed by SIGKILL: out of memory" in headings["sigkill"], \
        headings


def test_a_launch_whose_picked_port_is_taken_before_torchrun_binds_it_picks_another(tmp_path, monkeypatch):
    """Issue 36: a swift test lost the pick-then-bind race (EADDRINUSE on a port picked as free, taken by another
    job before torchrun bound it). The first pick here is a port another socket listens on: node 0's agent fails
    to listen, node 1's would wait for it; both are stopped, and the launch runs again on a fresh port. The same
    through ``run_logged``, as twinkle-sft's simulated nodes launch. Workers are plain Python: only agents start."""
    from twinkle_strategy.train import ports
    from twinkle_strategy.train.launcher import run_logged, run_simulated_nodes, torchrun_command

    script = tmp_path / "node.py"
    script.write_text("import os\nprint('joined as group rank', os.environ['GROUP_RANK'])\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = [taken.getsockname()[1]]
        real_free_port = ports.free_port

        def pick() -> int:  # the taken port first, then whatever the kernel gives
            picks.append(picks[0] if len(picks) == 1 else real_free_port())
            return picks[-1]

        monkeypatch.setattr(ports, "free_port", pick)
        result = run_simulated_nodes([str(script)], nnodes=2, nproc_per_node=1, timeout=240, log_dir=tmp_path)
        assert result.ok, [p.read_text() for p in result.log_paths]
        assert len(picks) == 3 and picks[2] != picks[0], picks  # [taken, taken (first pick), fresh]
        assert "joined as group rank 1" in (tmp_path / "node1.log").read_text()
        picks[1:] = []
        assert ports.on_a_free_port(lambda port, retry: run_logged(
            [torchrun_command([str(script)], 1, 0, 1, port)], str(tmp_path / "logged"), [0], [0],
            retry_if_port_taken=retry))
        assert len(picks) == 3, picks
