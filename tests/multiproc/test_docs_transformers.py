"""docs/transformers.md runs as written (issue 35): its ``python`` blocks, in order, as one script, launched by the
page's own single-machine torchrun command, on the demo model at 1 node x 2 ranks (one launch)."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

from multinode import REPO, WORKERS

PAGE = REPO / "docs" / "transformers.md"
_FENCE = re.compile(r"^( *)```(\w*)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    language: str
    line: int  # the page line of the block's first code line
    code: str


def page_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a markdown page, indented ones (in a list item) dedented."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None or not opening.group(2):
            i += 1
            continue
        indent, start = len(opening.group(1)), i + 1
        i = start
        while not re.match(rf"^ {{{indent}}}```\s*$", lines[i]):
            i += 1
        blocks.append(Block(opening.group(2), start + 1, "\n".join(line[indent:] for line in lines[start:i]) + "\n"))
        i += 1
    return blocks


def test_the_page_extracts_every_block():
    """Nothing runnable hides from the test: every python block the page has is one it runs (3 today: TRL,
    plain Trainer, the asynchronous save), and the single-machine command is there."""
    blocks = page_blocks(PAGE.read_text())
    python = [b for b in blocks if b.language == "python"]
    assert len(python) == PAGE.read_text().count("```python") == 3, [b.line for b in python]
    assert all(b.language in ("python", "bash") for b in blocks), [b.language for b in blocks]
    assert "import torch\n" in python[0].code and "use_cpu=" in python[0].code
    assert any(b.code.startswith("torchrun --standalone --nproc_per_node 2 sft.py") for b in blocks)
    assert 'mixed_precision="bf16"' in python[0].code and "dtype=torch.bfloat16" in python[0].code  # the default


def test_the_pages_python_runs_under_its_torchrun_command(tmp_path):
    text = PAGE.read_text()
    blocks = page_blocks(text)
    command = next(b.code.strip() for b in blocks if b.code.startswith("torchrun --standalone"))
    python = [{"line": b.line, "code": b.code} for b in blocks if b.language == "python"]
    (tmp_path / "blocks.json").write_text(json.dumps(python))
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the page's relative paths, from the repository root
    out = tmp_path / "out"
    out.mkdir()
    argv = shlex.split(command)
    assert argv[-1] == "sft.py", command
    argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:-1],
            str(WORKERS / "doc_blocks.py"), str(tmp_path / "blocks.json"), str(out), "docs/transformers.md"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TWINKLE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-8000:]
    ranks = {int(p.stem[4:]): json.loads(p.read_text())["blocks"] for p in out.glob("rank*.json")}
    assert sorted(ranks) == [0, 1], proc.stderr[-4000:]
    for records in ranks.values():
        assert [r["line"] for r in records] == [b["line"] for b in python]
        assert [r["trainer_class"] for r in records] == ["SFTTrainer", "Trainer", "SFTTrainer"]
        for record in records:
            assert record["trained"] and len(record["losses"]) == 3, record  # logging_steps=1, max_steps=3
    assert ranks[0] == ranks[1]  # one run: the same losses logged on both ranks
    # The TRL runs saved their LoRA adapters at step 3, the second in the background (async_save=True).
    for run in ("sft", "sft-async"):
        assert (tmp_path / "output" / run / "checkpoint-3" / "adapter_model.safetensors").is_file(), run
    assert "parallel_mode" not in proc.stderr  # use_cpu=True silences transformers' warning on a machine without GPUs
