"""One node's torchrun command line, and what it runs as each rank of a ``twinkle-sft`` launch."""

from __future__ import annotations

import json
import os
import sys

RANK_PROGRAM_ENV = "TWINKLE_RANK_PROGRAM"


def cli_rank_program(argv: list[str]) -> list[str]:
    """What torchrun runs as each rank of a ``twinkle-sft`` launch: this package's CLI as a module.

    ``$TWINKLE_RANK_PROGRAM`` (a JSON list: a script and its leading arguments) replaces the module, the arguments
    unchanged. It exists for the test suite, whose fork server starts each rank from an interpreter with torch and
    transformers imported already (tests/cli_preload.py): on 2 cores that start-up was most of a launch's time. A
    user has no reason to set it.
    """
    program = os.environ.get(RANK_PROGRAM_ENV)
    return [*json.loads(program), *argv] if program else ["-m", "twinkle_strategy.train.cli", *argv]


def torchrun_command(script_and_args: list[str], nnodes: int, node_rank: int, nproc: int, port: int, *,
                     max_restarts: int = 0, master_addr: str = "127.0.0.1", python: str | None = None) -> list[str]:
    """One node's torchrun; ``max_restarts``: times torchrun restarts the workers after a failure (the
    trainer of a restarted worker resumes from its run's newest complete checkpoint). ``python``: the interpreter
    that runs torchrun and its workers (another virtualenv's); this one's by default.

    Restarts use the c10d rendezvous: when one node's workers fail, every node's agent sees the new
    rendezvous round and restarts its workers too. The static one (``--master_addr``) restarts each node
    on its own schedule, and the new workers of one node time out waiting for the others.
    """
    if max_restarts > 0:
        # torch's c10d rendezvous otherwise shares one TCP store with the workers of every round, so a
        # restarted round's default process group can read a dead worker's address left by the last one
        # ("Gloo connectFullMesh failed ... Connection refused"), which costs the restart and leaves the
        # other node waiting. torch's own switch gives every round a fresh worker store on a new port.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master_addr}:{port}", "--rdzv_id", f"twinkle-{port}",
                 "--max_restarts", str(max_restarts)]
    else:
        where = ["--node_rank", str(node_rank), "--master_addr", master_addr, "--master_port", str(port)]
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--nproc_per_node", str(nproc), *where,
        *script_and_args,
    ]
