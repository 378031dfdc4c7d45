"""What the strategy started, stopped in order at exit or at shutdown() (twinkle_strategy.distributed.teardown)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

from twinkle_strategy.distributed import teardown


def test_stops_run_last_registered_first_once_each_past_a_failing_one(caplog):
    ran = []
    stops = teardown.Teardown()
    stops.on_exit(lambda: ran.append("process group"), what="the process group")
    stops.on_exit(lambda: ran.append("side group"), what="a side group")
    stops.on_exit(lambda: 1 / 0, what="a broken stop")
    stops.on_exit(lambda: ran.append("writer"), what="a writer thread")
    assert stops.pending() == ["a writer thread", "a broken stop", "a side group", "the process group"]
    with caplog.at_level(logging.WARNING, logger="twinkle_strategy.distributed.teardown"):
        stops.stop_all()
    assert ran == ["writer", "side group", "process group"]
    assert "stopping a broken stop failed: ZeroDivisionError" in caplog.text
    stops.stop_all()  # once each: nothing runs again
    assert ran == ["writer", "side group", "process group"] and stops.pending() == []


def test_setup_registers_the_process_group_it_makes_and_shutdown_tears_it_down_once():
    # In a fresh interpreter: this pytest process may hold a group an earlier test made.
    script = textwrap.dedent("""
        import torch.distributed as dist
        from twinkle_strategy import NativeFSDPStrategy
        from twinkle_strategy.distributed import teardown
        assert not dist.is_initialized()
        strategy = NativeFSDPStrategy(device_type="cpu")
        strategy.setup()  # a group of one (no torchrun): made by the strategy, so stopped at exit
        assert dist.is_initialized() and teardown.pending()[0] == "the process group", teardown.pending()
        strategy.shutdown()
        assert not dist.is_initialized() and teardown.pending() == [], teardown.pending()
        strategy.shutdown()  # idempotent
        assert not dist.is_initialized()
        print("torn down once")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "torn down once" in done.stdout, done.stderr[-3000:]
