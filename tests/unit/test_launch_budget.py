"""The suite's launch budget (tests/conftest.py) and launch table (tests/launch_log.py), on made-up sessions."""

import os
import subprocess
import sys
import types
from pathlib import Path

import conftest
import launch_log
import pytest

TESTS = Path(conftest.__file__).parent


def _config(*args, keyword="", markexpr="", maxfail=0):
    option = types.SimpleNamespace(keyword=keyword, markexpr=markexpr, deselect=None, lf=False, collectonly=False,
                                   maxfail=maxfail)
    return types.SimpleNamespace(option=option, args=list(args),
                                 invocation_params=types.SimpleNamespace(dir=TESTS.parent))


def test_only_a_tier_run_in_full_is_held_to_its_budget():
    assert conftest._tiers_run_in_full(_config("tests")) == list(conftest.TIERS)
    assert conftest._tiers_run_in_full(_config(str(TESTS.parent))) == list(conftest.TIERS)
    assert conftest._tiers_run_in_full(_config("tests/multiproc", "tests/unit")) == ["multiproc", "unit"]
    assert conftest._tiers_run_in_full(_config("tests/multiproc/test_smoke.py")) == []
    assert conftest._tiers_run_in_full(_config("tests", keyword="smoke")) == []
    assert conftest._tiers_run_in_full(_config("tests", markexpr="unit")) == []
    assert conftest._tiers_run_in_full(_config("tests", maxfail=1)) == []


def test_a_tier_over_its_budget_fails_the_session_in_one_line(monkeypatch):
    made_up = [launch_log.Launch(f"tests/multiproc/test_x.py::test_{i}", "python", 0.0, ended=1.0)
               for i in range(conftest.LAUNCH_BUDGET["multiproc"] + 1)]
    monkeypatch.setattr(launch_log, "LAUNCHES", made_up)
    monkeypatch.setattr(conftest, "_over_budget", [])
    session = types.SimpleNamespace(config=_config("tests/multiproc"), exitstatus=pytest.ExitCode.OK)
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    count, budget = len(made_up), conftest.LAUNCH_BUDGET["multiproc"]
    assert conftest._over_budget == [f"launch budget: tests/multiproc made {count} launches, over its budget of "
                                     f"{budget} (tests/conftest.py LAUNCH_BUDGET); ride an existing launch "
                                     f"(tests/launches.py) instead of adding one"]
    # Within the budget, or a tier not run in full: nothing.
    monkeypatch.setattr(conftest, "_over_budget", [])
    monkeypatch.setattr(launch_log, "LAUNCHES", made_up[:-1])
    session = types.SimpleNamespace(config=_config("tests/multiproc"), exitstatus=pytest.ExitCode.OK)
    conftest.pytest_sessionfinish(session, 0)
    assert session.exitstatus == pytest.ExitCode.OK and conftest._over_budget == []


def test_the_table_counts_each_launch_and_the_python_processes_under_it():
    """A process started through subprocess (conftest installed the recorder) is one launch of the test that
    started it, with its Python children counted by the /proc sampler."""
    before = len(launch_log.LAUNCHES)
    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(2)']); p.wait()"
    subprocess.run([sys.executable, "-c", child], check=True, env={**os.environ, "PYTHONPATH": ""})
    subprocess.run(["true"], check=True)  # not a launcher: not counted
    new = launch_log.LAUNCHES[before:]
    assert len(new) == 1, new
    assert new[0].test.endswith("::test_the_table_counts_each_launch_and_the_python_processes_under_it")
    assert new[0].processes == 2 and 1.5 < new[0].seconds < 60, new[0]
    lines = launch_log.table_lines()
    assert any(line.endswith("tests/unit/test_launch_budget.py") for line in lines), lines


def test_the_table_counts_forked_ranks_and_each_fallback_by_reason():
    """tests/preload.py's outcome of each rank (multinode.launch records it on the launch): the table says how
    many ranks were forked from the preloaded interpreter and why the others started fresh."""
    launches = [launch_log.Launch("t::a", "w.py 2x2", 0.0, forked=4),
                launch_log.Launch("t::b", "w.py 2x1", 0.0, fallbacks=["TMPDIR differs", "TMPDIR differs"]),
                launch_log.Launch("t::c", "w.py 1x1", 0.0, fallbacks=["HF_HOME differs"])]
    assert launch_log.preload_lines(launches) == [
        "preloaded ranks and agents (tests/preload.py): 4 forked, 3 started fresh",
        "     2 fresh: TMPDIR differs", "     1 fresh: HF_HOME differs"]
    assert launch_log.preload_lines(launches[:0]) == []  # TWINKLE_TEST_PRELOAD=0: no line


def test_a_workers_launches_reach_the_controllers_table_unchanged():
    """tests/parallel_workers.py: an xdist worker sends its launches as JSON; the controller's table is the one the
    worker would have printed."""
    import json

    launches = [launch_log.Launch("tests/multiproc/test_a.py::t", "w.py 2x2", 0.0, python={11, 12, 13}, ended=4.5,
                                  forked=4),
                launch_log.Launch("tests/unit/test_b.py::t", "python -c", 0.0, python={14}, ended=0.5,
                                  fallbacks=["TMPDIR differs"])]
    received = launch_log.from_records(json.loads(json.dumps(launch_log.to_records(launches))))
    assert [(x.test, x.program, x.seconds, x.processes, x.forked, x.fallbacks) for x in received] == \
        [(x.test, x.program, x.seconds, x.processes, x.forked, x.fallbacks) for x in launches]
    assert launch_log.preload_lines(received) == launch_log.preload_lines(launches)


def test_each_file_stays_on_one_worker_and_each_virtualenv_tier_whole():
    import parallel_workers

    scope = parallel_workers._scope
    assert scope("tests/multiproc/test_a.py::test_x[p]") == scope("tests/multiproc/test_a.py::test_y") \
        == "tests/multiproc/test_a.py"
    assert scope("tests/multiproc/test_a.py::t") != scope("tests/multiproc/test_b.py::t")
    assert scope("tests/swift_plugin/test_swift.py::t") == scope("tests/swift_plugin/test_swift_one_sp_meaning.py::t")
    assert scope("tests/vllm_engine/test_vllm_sync.py::t") == scope("tests/vllm_engine/test_grpo_colocate.py::t")
    assert scope("tests/vllm_engine/test_vllm_sync.py::t") != scope("tests/swift_plugin/test_swift.py::t")


def test_a_value_once_per_run_is_computed_by_the_first_worker_and_read_by_the_other(tmp_path, monkeypatch):
    import parallel_workers

    class Factory:  # what a worker's tmp_path_factory gives: its own folder inside the run's
        def __init__(self, worker):
            self.base = tmp_path / f"popen-{worker}"

        def getbasetemp(self):
            return self.base

    calls = []
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    first = parallel_workers.once_per_run(Factory("gw0"), "thing", lambda: calls.append(1) or {"built": len(calls)})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    second = parallel_workers.once_per_run(Factory("gw1"), "thing", lambda: calls.append(1) or {"built": len(calls)})
    assert first == second == {"built": 1} and calls == [1]
    monkeypatch.delenv("PYTEST_XDIST_WORKER")  # one process: a session fixture's own value
    assert parallel_workers.once_per_run(Factory("x"), "thing", lambda: "fresh") == "fresh"
