"""Shared plumbing for worker scripts: per-rank result files and clean exits."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def write_result(data: dict) -> None:
    """Merge ``data`` into this rank's result file (written atomically)."""
    out = os.environ["TWINKLE_TEST_OUT"]
    path = os.path.join(out, f"rank{rank()}.json")
    previous = {}
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
    data = {**previous, "rank": rank(), **data}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def run(main, *, failure_waits_for_every_rank_s: float = 0.0) -> None:
    """Run ``main()``; record its result or its error for this rank, exit non-zero on error.

    ``failure_waits_for_every_rank_s``: for a worker whose test expects every rank to raise (a refusal). The first
    rank to exit non-zero makes torchrun stop the others, and a rank stopped before it wrote its error fails the
    test for nothing (full runs saw it). So a failing rank waits, up to that many seconds, until every rank has
    recorded its own result."""
    torch.set_num_threads(1)
    try:
        result = main() or {}
        write_result({"ok": True, **result})
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the test reads the error from the file
        write_result({"ok": False, "error_type": type(exc).__name__, "error": str(exc),
                      "traceback": traceback.format_exc()})
        traceback.print_exc()
        code = 1
    if failure_waits_for_every_rank_s:
        try:
            file_barrier(os.environ["TWINKLE_TEST_OUT"], "result-recorded", world=int(os.environ["WORLD_SIZE"]),
                         timeout_s=failure_waits_for_every_rank_s, wait=code != 0)
        except TimeoutError:
            pass  # a rank that never records (it hung, or died): the test reports it
    if dist.is_initialized() and code == 0:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def file_barrier(directory: str, name: str, *, world: int, timeout_s: float, wait: bool = True) -> None:
    """Mark that this rank reached ``name`` (a file in ``directory``); with ``wait``, return once ``world`` ranks have.
    Files, not a collective: the callers need it where a process group cannot be relied on."""
    open(os.path.join(directory, f"{name}.rank{rank()}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while wait and len([n for n in os.listdir(directory) if n.startswith(f"{name}.rank")]) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {name} within {timeout_s:.0f} s")
        time.sleep(0.01)
