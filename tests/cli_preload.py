"""``twinkle-sft`` launches whose ranks fork from the suite's preload servers (tests/preload_servers.py).

``twinkle-sft`` builds each rank's command itself (``torchrun ... -m twinkle_strategy.train.cli ARGS``), so the
fork server's client cannot be put in front of it as :func:`multinode.launch` does. Its one seam,
``$TWINKLE_RANK_PROGRAM`` (twinkle_strategy/train/torchrun.cli_rank_program), names the client and
tests/workers/twinkle_sft_rank.py instead. Each rank then starts in a fraction of a second instead of importing torch
and transformers (5-8 s on 2 cores). A rank whose environment differs where a module may read it at import (a
restart's TORCH_DISABLE_SHARE_RDZV_TCP_STORE, a test's HF_HOME) still starts fresh, and the launch table counts it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import preload_servers
from multinode import WORKERS, launch_env

from twinkle_strategy.train.torchrun import RANK_PROGRAM_ENV

_ids = itertools.count()


def cli_env(env: dict[str, str], *, python: str = sys.executable) -> dict[str, str]:
    """``env`` for a ``twinkle-sft`` process, with its ranks forked from the preload servers; ``env`` as it is where
    preloading is off (``TWINKLE_TEST_PRELOAD=0``). The ranks get what every ``multinode.launch`` rank gets
    (``launch_env``), so they match the servers' environment."""
    if not preload_servers.enabled():
        return env
    every_rank = launch_env(Path(tempfile.gettempdir()))
    env = {**env, **{k: v for k, v in every_rank.items() if k != "TWINKLE_TEST_OUT"}}
    log = Path(tempfile.gettempdir()) / f"twinkle-preload-cli-{os.getpid()}-{next(_ids)}.jsonl"
    command, env = preload_servers.preloaded_command([str(WORKERS / "twinkle_sft_rank.py")], env, python, log,
                                                     server_env={**os.environ, **every_rank})
    return {**env, RANK_PROGRAM_ENV: json.dumps(command)}


def cli_command(env: dict[str, str], *, python: str = sys.executable) -> list[str]:
    """``python -m twinkle_strategy.train.cli``, for a process with :func:`cli_env`'s ``env``: where the ranks fork,
    the launcher forks too (its imports, the fit check's torch and transformers, are about 5 s of CPU), through the
    stand-in interpreter multinode.launch's agents use (preload_servers.forking_python). Its torchrun agents start
    with the real interpreter, fresh. Off with TWINKLE_TEST_PRELOAD_AGENTS=0."""
    forks = preload_servers.SOCKET_ENV in env and preload_servers.agents_enabled()
    return [preload_servers.forking_python(python) if forks else python, "-m", "twinkle_strategy.train.cli"]
