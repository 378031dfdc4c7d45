"""Where a run's results are: its log lines (``logging.jsonl``) and the lines that say where everything went.

twinkle-sft writes ``logging.jsonl`` in its run directory, the ``transformers.Trainer`` mixin (HF, TRL) in
``output_dir``, as ms-swift does: the same file name and form, whichever front-end trained, written by the main
process. When training ends, each front-end prints :func:`where_results_are`: the run directory, the last
checkpoint, the log file.
"""

from __future__ import annotations

import json
import os

LOG_FILE = "logging.jsonl"


def log_path(directory: str) -> str:
    """Where ``directory``'s log lines are."""
    return os.path.join(directory, LOG_FILE)


def append_log(directory: str, entry: dict) -> None:
    """``entry`` as the next line of ``directory``'s ``logging.jsonl`` (created with its directory if need be)."""
    os.makedirs(directory, exist_ok=True)
    with open(log_path(directory), "a") as f:
        f.write(json.dumps(entry) + "\n")


def rewrite_log(directory: str, entries: list[dict]) -> None:
    """``logging.jsonl`` holding exactly ``entries`` (written aside, then renamed over the old one): a resumed run's
    history up to its checkpoint, without the lines a crashed run logged after it."""
    os.makedirs(directory, exist_ok=True)
    path = log_path(directory)
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    os.replace(path + ".tmp", path)


def where_results_are(*, run_directory: str, last_checkpoint: str | None, log_file: str | None,
                      merged: str | None = None) -> str:
    """The lines a front-end prints when training ends (no trailing newline): ``run directory: ...``,
    ``last checkpoint: ...`` (``none saved``), ``merged model: ...`` when there is one, ``log: ...`` when written."""
    lines = [f"run directory: {run_directory}", f"last checkpoint: {last_checkpoint or 'none saved'}"]
    if merged:
        lines.append(f"merged model: {merged}")
    if log_file:
        lines.append(f"log: {log_file}")
    return "\n".join(lines)
