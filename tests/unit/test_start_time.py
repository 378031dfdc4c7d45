"""The start line's clock (twinkle_strategy/train/start_time.py): a process's start from /proc, the launcher's times
handed to the ranks, the parts adding up. The line of a real launch: tests/multiproc/test_trainer_cli.py."""

import os
import subprocess
import time

import pytest

from twinkle_strategy.train.start_time import (
    LAUNCH_TIMES_ENV,
    LaunchClock,
    LauncherTimes,
    StartClock,
    process_start_time,
)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="a process's start is read from /proc")


def test_a_process_start_is_when_it_was_started():
    before = time.time()
    child = subprocess.Popen(["sleep", "5"])  # (not a Python process: no launch for the unit tier's budget)
    try:
        after = time.time()
        started = process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    # /proc counts in clock ticks (10 ms); the uptime it is read against in hundredths of a second.
    assert before - 0.05 <= started <= after + 0.05, (before, started, after)
    assert process_start_time() <= before  # this process started before its child


def test_the_launchers_times_reach_its_ranks_only_during_the_launch(monkeypatch):
    monkeypatch.delenv(LAUNCH_TIMES_ENV, raising=False)
    clock = LaunchClock.now()
    with clock.planning():
        time.sleep(0.05)
    with clock.handed_over():
        told = LauncherTimes.from_env()
    assert told is not None and told.started == clock.started and told.plan_s == clock.plan_s >= 0.05
    assert clock.started + told.plan_s <= told.handed_over <= time.time()
    assert LAUNCH_TIMES_ENV not in os.environ  # nothing started later from this process reads a stale launch


def _start(launcher: LauncherTimes | None) -> StartClock:
    clock = StartClock(launcher)
    with clock.loading_data():
        time.sleep(0.02)
    time.sleep(0.01)
    clock.ready()
    time.sleep(0.03)
    return clock


def test_the_parts_follow_one_another_and_add_up_to_the_total():
    # A launcher that started 3 s ago, planned for 1 s and handed over before this process started.
    now, started = time.time(), process_start_time()
    launcher = LauncherTimes(started=started - 3, plan_s=1.0, handed_over=started - 0.5)
    clock = _start(launcher)
    times = clock.first_step_done()
    assert clock.first_step_done() is None  # once
    parts = times.parts()
    assert list(parts) == ["plan", "launch", "imports", "init", "data", "first step"]
    assert all(seconds >= 0 for seconds in parts.values()), parts
    assert times.plan == 1.0 and times.launch == pytest.approx(2.0, abs=0.05)  # 3 s less the plan's 1 s
    assert times.imports == pytest.approx(clock.trainer_started - started, abs=0.05)
    assert times.data >= 0.02 and times.init >= 0.01 and times.first_step >= 0.03, times
    assert sum(parts.values()) == pytest.approx(times.total, abs=1e-3)
    assert times.total >= time.time() - now + 3 - 0.1
    line = times.line()
    assert line.startswith(f"start: {times.total:.1f} s to the first step (plan 1.0 s, launch 2.0 s, imports "), line
    assert line.endswith(f"data {times.data:.1f} s, first step {times.first_step:.1f} s)"), line
    fields = clock.take_log_fields()
    assert fields["start(s)"] == round(times.total, 3) and set(fields["start_parts(s)"]) == \
        {"plan", "launch", "imports", "init", "data", "first_step"}
    assert clock.take_log_fields() == {}  # in one log entry only


def test_training_in_the_launchers_process_counts_its_imports_in_launch():
    # One process: the launcher handed over to itself after this process (the launcher) started.
    launcher = LauncherTimes(started=process_start_time(), plan_s=0.0, handed_over=time.time())
    times = _start(launcher).first_step_done()
    assert 0 <= times.imports < 0.5 and times.launch >= 0, times
    assert sum(times.parts().values()) == pytest.approx(times.total, abs=1e-3)


def test_a_rank_no_launcher_told_counts_from_its_own_start(monkeypatch):
    monkeypatch.delenv(LAUNCH_TIMES_ENV, raising=False)
    clock = _start(None)
    times = clock.first_step_done()
    assert times.plan is None and times.launch is None and list(times.parts()) == ["imports", "init", "data",
                                                                                     "first step"]
    assert times.total == pytest.approx(sum(times.parts().values()), abs=1e-3)
    assert "plan" not in times.line() and times.line().startswith("start: ")


def test_before_the_trainer_is_set_up_there_is_no_first_step():
    assert StartClock(None).first_step_done() is None
