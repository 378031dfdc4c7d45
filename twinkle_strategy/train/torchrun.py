"""One node's torchrun command line, and what it runs as each rank of a ``twinkle-sft`` launch."""

from __future__ import annotations

import os
import sys


def cli_rank_program(argv: list[str]) -> list[str]:
    """What torchrun runs as each rank of a ``twinkle-sft`` launch: this package's CLI as a module, with the
    launcher's arguments (torchrun starts it with the interpreter that runs torchrun: see :func:`torchrun_command`)."""
    return ["-m", "twinkle_strategy.train.cli", *argv]


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
