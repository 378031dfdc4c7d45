"""``swift sft`` launches whose ranks fork from the suite's preload servers (tests/preload_servers.py).

Each rank of ``swift sft`` imports ms-swift's training pipeline (``from swift.pipelines import sft_main``: about 11 s
of CPU on this machine) before it trains for a few seconds. ms-swift's console script (``swift.cli.main.cli_main``)
runs ``torchrun ... swift/cli/sft.py ARGS``, or ``python swift/cli/sft.py ARGS`` without ``NPROC_PER_NODE``, so the
fork server's client cannot be put in front of it from outside. ``cli_main`` takes its route mapping as an argument:
tests/workers/swift_cli.py runs ms-swift's own ``cli_main`` with ``sft`` routed to tests/workers/swift_sft_rank.py,
which hands ``swift/cli/sft.py`` and its arguments to the fork server. ms-swift's argument handling, its torchrun
command and torchrun itself stay as a user runs them; only the ranks' imports are shared.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path

import preload_servers
from multinode import WORKERS, launch_env

_ids = itertools.count()


def swift_command(swift_bin: Path, env: dict[str, str]) -> tuple[list[str], dict[str, str], Path | None]:
    """The command that stands for ms-swift's ``swift`` (``sft`` and its arguments follow it), ``env`` for it, and the
    preload log the launch table reads (None: preloading is off, ``TWINKLE_TEST_PRELOAD=0``, and the command is
    ms-swift's console script itself)."""
    if not preload_servers.enabled():
        return [str(swift_bin / "swift")], env, None
    log = Path(tempfile.gettempdir()) / f"twinkle-preload-swift-{os.getpid()}-{next(_ids)}.jsonl"
    # The servers of this interpreter are the ones multinode.launch(python=...) uses: the same environment.
    server_env = {**os.environ, **launch_env(Path(tempfile.gettempdir()))}
    _, env = preload_servers.preloaded_command([], env, str(swift_bin / "python"), log, server_env=server_env)
    return [str(swift_bin / "python"), str(WORKERS / "swift_cli.py")], env, log
