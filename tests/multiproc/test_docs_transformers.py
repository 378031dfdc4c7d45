"""docs/transformers.md runs as written (issue 35): its ``python`` blocks, in order, as one script, launched by the
page's own single-machine torchrun command, on the demo model at 1 node x 2 ranks (tests/launches.py's
``doc_pages`` launch, shared with docs/rl.md and docs/strategy.md: tests/multiproc/test_docs_rl.py)."""

from doc_pages import page_blocks
from multinode import REPO

PAGE_NAME = "docs/transformers.md"
PAGE = REPO / PAGE_NAME


def test_the_page_extracts_every_block():
    """Nothing runnable hides from the test: every python block the page has is one it runs (3 today: TRL,
    plain Trainer, the asynchronous save), and the single-machine command is there."""
    blocks = page_blocks(PAGE.read_text())
    python = [b for b in blocks if b.language == "python"]
    assert len(python) == PAGE.read_text().count("```python") == 3, [b.line for b in python]
    assert all(b.not_run is None for b in python), [b.line for b in python if b.not_run]
    assert all(b.language in ("python", "bash") for b in blocks), [b.language for b in blocks]
    assert "import torch\n" in python[0].code and "use_cpu" not in python[0].code  # issue 47
    assert any(b.code.startswith("torchrun --standalone --nproc_per_node 2 sft.py") for b in blocks)
    assert 'mixed_precision="bf16"' in python[0].code and "dtype=torch.bfloat16" in python[0].code  # the default


def test_the_pages_python_runs_under_its_torchrun_command(doc_pages):
    python = [b for b in page_blocks(PAGE.read_text()) if b.language == "python"]
    assert doc_pages.commands[PAGE_NAME][-1] == "sft.py", doc_pages.commands
    assert doc_pages.returncode == 0, doc_pages.stderr[-8000:]
    ranks = {rank: pages[PAGE_NAME] for rank, pages in doc_pages.records.items()}
    assert sorted(ranks) == [0, 1], doc_pages.stderr[-4000:]
    for records in ranks.values():
        assert [r["line"] for r in records] == [b.line for b in python]
        assert [r["trainer_class"] for r in records] == ["SFTTrainer", "Trainer", "SFTTrainer"]
        for record in records:
            assert record["trained"] and len(record["losses"]) == 3, record  # logging_steps=1, max_steps=3
    assert ranks[0] == ranks[1]  # one run: the same losses logged on both ranks
    # The TRL runs saved their LoRA adapters at step 3, the second in the background (async_save=True).
    for run in ("sft", "sft-async"):
        assert (doc_pages.work / "output" / run / "checkpoint-3" / "adapter_model.safetensors").is_file(), run
    # No page sets use_cpu: the strategy tells accelerate the job runs on the CPU, so transformers does not warn
    assert "parallel_mode" not in doc_pages.stderr
