"""What every benchmark script does around its measurement: a rank's result file, the command that reproduces a
table, and the table written as Markdown and JSON next to each other in ``benchmarks/results/``."""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable


def record_rank(measure: Callable[[], dict], *, results_dir: str, prefix: str = "", method: str | None = None,
                exit_code_on_error: int = 1, last_line_only: bool = False) -> None:
    """Run this rank's measurement, write ``{prefix}rank{RANK}.json`` and leave the process at once.

    A rank that fails is a result too (a method a peer cannot run is a row of the table, not a crash of the
    benchmark), so the exception is written down in place of the figures. ``os._exit``: nothing the run left
    behind (a process group, a pool's threads) may keep the rank alive or change its exit code.
    ``last_line_only``: errors that wrap every rank's traceback (DCP's CheckpointException) end with the message.
    """
    rank = int(os.environ["RANK"])
    try:
        result = measure()
    except BaseException as exc:  # noqa: BLE001 - see above (DCP raises BaseException subclasses)
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        message = lines[-1].strip() if last_line_only and len(lines) > 1 else str(exc)
        result = {"rank": rank, "error": f"{type(exc).__name__}: {message}", "traceback": traceback.format_exc()}
        if method is not None:
            result["method"] = method
    with open(os.path.join(results_dir, f"{prefix}rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(exit_code_on_error if isinstance(result, dict) and "error" in result else 0)


def command_line(script: str) -> str:
    """The command that reproduces this run, as the tables quote it."""
    return " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]).strip()


def write_results(out_dir: str, name: str, *, text: str, payload: dict) -> None:
    """``{name}.md`` (the table as the README and docs quote it) and ``{name}.json`` (the figures) in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=1, default=str)  # (dates, paths: as text)
    print(f"wrote {out_dir}/{name}.md, .json")
