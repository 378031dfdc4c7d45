"""docs/rl.md and docs/strategy.md run as written (issue 47): each page's ``python`` blocks, in order, as one script,
under the page's own single-machine torchrun command, on the demo model at 1 node x 2 ranks. They ride the launch
that runs docs/transformers.md (tests/launches.py's ``doc_pages``: the three commands differ only in the script's
name). Blocks the suite cannot run (vLLM, a server, NCCL) say so, with the reason, on the line before their fence."""

import glob
import json
import math
import re

from doc_pages import page_blocks, runnable_python
from multinode import REPO

RL, STRATEGY = "docs/rl.md", "docs/strategy.md"
NOT_RUN_ON_RL = 5  # vLLM's routing capture, VLLMReceiver, ProcessSender into an engine, GRPO colocate, vLLM server


def _blocks(page: str):
    return page_blocks((REPO / page).read_text())


def test_the_rl_page_leads_with_a_complete_grpo_script_and_its_command():
    text = (REPO / RL).read_text()
    blocks = _blocks(RL)
    python = [b for b in blocks if b.language == "python"]
    assert len(python) == text.count("```python"), [b.line for b in python]  # no python block hides from the test
    assert {b.language for b in blocks} <= {"python", "bash", "text"}, [b.language for b in blocks]
    assert re.findall(r"^## (.+)$", text, flags=re.M)[0] == "GRPO with TRL"  # the script first, then the concepts
    assert blocks[0].code.strip() == "torchrun --standalone --nproc_per_node 2 grpo.py"
    script = python[0]
    assert script.not_run is None and script.line > blocks[0].line
    for needed in ("import torch\n", "from trl import GRPOConfig, GRPOTrainer", "def correct_answer(", "LoraConfig(",
                   "with_strategy(GRPOTrainer)(", "routing_replay=", "trainer.train()"):
        assert needed in script.code, needed
    assert "use_cpu" not in script.code  # issue 47: a CPU run needs no use_cpu (the strategy tells accelerate)
    assert "### Why `grad_norm`" in text and "frac_reward_zero_std" in text


def test_every_block_not_run_says_why_and_which_test_runs_it():
    """The few blocks the suite cannot run give a reason and name the test that covers their path instead."""
    skipped = [b for b in _blocks(RL) + _blocks(STRATEGY) if b.not_run is not None]
    assert len(skipped) == NOT_RUN_ON_RL, [(b.line, b.not_run) for b in skipped]
    for block in skipped:
        assert block.language == "python" and len(block.not_run) > 20, block
        tests = re.findall(r"tests/\S+?\.py", block.not_run)
        assert tests and all((REPO / t).is_file() for t in tests), block.not_run


def test_the_strategy_page_runs_whole():
    blocks = _blocks(STRATEGY)
    python = [b for b in blocks if b.language == "python"]
    assert python and python == runnable_python(blocks)
    assert any(b.code.startswith("torchrun --standalone --nproc_per_node 2 loop.py") for b in blocks)


def test_the_pages_python_runs_under_their_torchrun_commands(doc_pages):
    assert doc_pages.commands[RL][-1] == "grpo.py" and doc_pages.commands[STRATEGY][-1] == "loop.py"
    assert doc_pages.returncode == 0, doc_pages.stderr[-8000:]
    assert sorted(doc_pages.records) == [0, 1], doc_pages.stderr[-4000:]
    rl = {rank: pages[RL] for rank, pages in doc_pages.records.items()}
    assert rl[0] == rl[1]  # one run: the same log lines on both ranks
    assert [r["line"] for r in rl[0]] == [b.line for b in runnable_python(_blocks(RL))]
    grpo = rl[0][0]
    assert grpo["trained"] and grpo["trainer_class"] == "GRPOTrainer" and len(grpo["log"]) == 4, grpo
    assert (doc_pages.work / "output" / "grpo" / "checkpoint-4" / "adapter_model.safetensors").is_file()
    # The export block sent the model to its receiver: each rank prints the report's line. (Not anchored to line
    # starts: the ranks share one stdout, and print writes a line's text and its newline apart, so lines interleave.)
    exported = re.findall(r"weight export: (\d+) tensors", doc_pages.stdout)
    assert len(exported) == 2 and int(exported[0]) > 0, doc_pages.stdout[-2000:]
    # strategy.md's loop: the step's loss and token count, the same on every rank
    losses = dict(re.findall(r"rank (\d): (loss [\d.]+ over \d+ tokens)", doc_pages.stdout))
    assert sorted(losses) == ["0", "1"] and losses["0"] == losses["1"], doc_pages.stdout[-2000:]


def test_grad_norm_is_the_small_terms_alone_when_every_group_has_one_reward(doc_pages):
    """What the page says of grad_norm, on its own GRPO run: a step whose groups each got one reward for all their
    completions (frac_reward_zero_std = 1) has zero advantages, so its loss is the load-balancing term alone
    (beta = 0) and its gradient is small; a step with a mixed group moves far more."""
    config = glob.glob(str(doc_pages.work / "cache" / "demo-*" / "model" / "config.json"))
    coefficient = json.loads(open(config[0]).read())["router_aux_loss_coef"]
    lines = doc_pages.records[0][RL][0]["log"]
    flat = [h for h in lines if h["frac_reward_zero_std"] == 1.0]
    mixed = [h for h in lines if h["frac_reward_zero_std"] < 1.0]
    assert flat and mixed, lines  # the page's run shows both (seeded; its numbers are on the page)
    for h in flat:
        assert math.isclose(h["loss"], coefficient * h["aux_loss"], rel_tol=1e-4), h
    assert max(h["grad_norm"] for h in flat) * 20 < min(h["grad_norm"] for h in mixed), lines
