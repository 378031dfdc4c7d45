"""``twinkle-sft`` launches whose launcher and ranks fork from the suite's preload servers (tests/preload_servers.py).

``twinkle-sft`` builds each rank's command itself: ``torchrun ... -m twinkle_strategy.train.cli ARGS``, torchrun run
with the launcher's ``sys.executable``, which torchrun's agents use for their ranks in turn. So the suite runs the
launcher under a stand-in interpreter (:func:`preload_servers.forking_python` with ``programs``): the launcher is
forked from a preloaded interpreter and has the stand-in for its ``sys.executable``; its torchrun agents start fresh
(its signal and restart tests are about them), still as the stand-in; and each rank is forked, running
tests/workers/twinkle_sft_rank.py in place of ``-m twinkle_strategy.train.cli``: the CLI's ``main`` with the hooks
a test asks for in the rank (the save writer's pause). Each rank then starts in a fraction of a second instead of
importing torch and transformers (5-8 s on 2 cores). A rank whose environment differs where a module may read it at
import (a test's HF_HOME) still starts fresh, and the launch table counts it. Nothing in the package knows of this.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path

import preload_servers
from multinode import WORKERS, launch_env

RANK_PROGRAMS = {"twinkle_strategy.train.cli": str(WORKERS / "twinkle_sft_rank.py")}
FRESH_MODULES = ("torch.distributed.run",)  # twinkle-sft's torchrun agents
_ids = itertools.count()


def cli_env(env: dict[str, str], *, python: str = sys.executable) -> dict[str, str]:
    """``env`` for a ``twinkle-sft`` process, with its ranks forked from the preload servers; ``env`` as it is where
    preloading is off (``TWINKLE_TEST_PRELOAD=0``: the stand-in runs everything fresh). The ranks get what every
    ``multinode.launch`` rank gets (``launch_env``), so they match the servers' environment."""
    if not preload_servers.enabled():
        return env
    every_rank = launch_env(Path(tempfile.gettempdir()))
    env = {**env, **{k: v for k, v in every_rank.items() if k != "TWINKLE_TEST_OUT"}}
    log = Path(tempfile.gettempdir()) / f"twinkle-preload-cli-{os.getpid()}-{next(_ids)}.jsonl"
    _, env = preload_servers.preloaded_command([], env, python, log, server_env={**os.environ, **every_rank})
    return env


def cli_command(env: dict[str, str], *, python: str = sys.executable) -> list[str]:
    """``python -m twinkle_strategy.train.cli``, for a process with :func:`cli_env`'s ``env``, under the stand-in
    interpreter (see the module's docstring)."""
    stand_in = preload_servers.forking_python(python, programs=RANK_PROGRAMS, fresh=FRESH_MODULES)
    return [stand_in, "-m", "twinkle_strategy.train.cli"]
