"""Doc pages that run as written (issues 35 and 47): a page's fenced code blocks, the few it marks as not run here
(each with its reason), and one launch that runs several pages' ``python`` blocks, each page as one script, under
the single-machine ``torchrun`` command the pages share.

A block the suite cannot run (vLLM, a server, NCCL, several machines) is marked on the line before its fence::

    <!-- not run here: why, and which test runs that path instead -->

tests/multiproc/test_docs_transformers.py and test_docs_rl.py assert on the launch (tests/launches.py's
``doc_pages`` fixture runs it once per pytest run)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from multinode import REPO, WORKERS

_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run here:(.*?)-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    language: str
    line: int  # the page line of the block's first code line
    code: str
    not_run: str | None = None  # the reason the page gives for not running it here; None: it runs


def page_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown page, indented ones (in a list item) dedented."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or not opening.group(2):
            i += 1
            continue
        marker = _NOT_RUN.match(lines[i - 1]) if i > 0 else None
        indent, start = len(opening.group(1)), i + 1
        i = start
        while not re.match(rf"^ {{{indent}}}```\s*$", lines[i]):
            i += 1
        blocks.append(Block(opening.group(2), start + 1, "\n".join(line[indent:] for line in lines[start:i]) + "\n",
                            None if marker is None else marker.group(1).strip()))
        i += 1
    return blocks


def runnable_python(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.language == "python" and b.not_run is None]


def launch_command(blocks: list[Block]) -> list[str]:
    """The page's single-machine command (its first ``torchrun --standalone`` block), as argv."""
    return shlex.split(next(b.code.strip() for b in blocks if b.code.startswith("torchrun --standalone")))


@dataclasses.dataclass(frozen=True)
class PagesRun:
    """One launch of several pages: its exit, output, working directory (the pages' relative paths resolve there)
    and, per rank, per page, what each of its blocks did (tests/workers/doc_blocks.py's records)."""
    returncode: int
    stdout: str
    stderr: str
    work: Path
    commands: dict[str, list[str]]  # page -> its own torchrun command, as argv
    records: dict[int, dict[str, list[dict]]]


def run_pages(pages: list[str], work: Path) -> PagesRun:
    """Every runnable ``python`` block of ``pages`` (paths from the repository root), each page in its own
    namespace, in one launch: the pages' torchrun options (they must agree; each names its own script), running
    tests/workers/doc_blocks.py, on the demo model built afresh in ``work``'s cache."""
    commands, payload = {}, []
    for page in pages:
        blocks = page_blocks((REPO / page).read_text())
        commands[page] = launch_command(blocks)
        payload.append({"page": page, "blocks": [{"line": b.line, "code": b.code} for b in runnable_python(blocks)]})
    options = {page: argv[1:-1] for page, argv in commands.items()}
    assert len({tuple(o) for o in options.values()}) == 1, options  # one launch serves them all only if so
    (work / "pages.json").write_text(json.dumps(payload))
    (work / "examples").symlink_to(REPO / "examples")  # the pages' relative paths, from the repository root
    out = work / "records"
    out.mkdir()
    argv = [sys.executable, "-m", "torch.distributed.run", *options[pages[0]],
            str(WORKERS / "doc_blocks.py"), str(work / "pages.json"), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TWINKLE_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "datasets"),
           # The ranks share one stdout: unbuffered, each printed line's text reaches it in one write (a buffer
           # flushed at exit could cut a line in two around the other rank's output).
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    records = {int(p.stem[4:]): json.loads(p.read_text())["pages"] for p in out.glob("rank*.json")}
    return PagesRun(proc.returncode, proc.stdout, proc.stderr, work, commands, records)
