"""One message, not a wall: a package error ends a plain-torchrun job in one line per distinct error, root cause first.

One launch (2 simulated nodes x 1 rank, a user's HF Trainer script under plain torchrun, no try/except): rank 1
raises a ModelStructureError at step 2, which leaves rank 0 in that step's FSDP all-gather until it loses the
peer. Each node's terminal then shows its rank's one line (torchrun's own failure block after it is not
counted), and each rank's traceback is in the file the line names. The rest runs in this process: which rank says
what (ranks sharing a real TCPStore as torchrun's workers share the agent's), and twinkle-sft's summary order:
tests/unit/test_fatal_error_lines.py.

A second launch (1 node x 2 ranks, a user's GRPO script, torchrun restarting its workers 5 times) makes issue 47's
six usual mistakes, one per round: each round's output is one line, or for an error that is not the package's its
traceback once, and torchrun's closing report names the line.
"""

from __future__ import annotations

from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

INJECTED = "ModelStructureError: router_aux_loss_coef: injected on one rank by the test"  # tests/workers/fatal_line.py
# tests/workers/user_mistakes.py's mistakes, in its order (one per torchrun round), and the error each ends with.
PACKAGE_MISTAKES = {
    "routing_replay_value": "StrategyConfigError: routing_replay is one of ('auto', 'r3', 'r2', 'off'), not 'R3x'",
    "misspelt_keyword": "UnknownKeywordError: StrategyGRPOTrainer takes no keyword argument routing_reply=; did you "
                        "mean routing_replay?",
    "ep_size_too_large": "ParallelConfigError: ep_size 4 needs 4 processes (or a multiple), this job has 2: launch "
                         "them, e.g. torchrun --nproc_per_node 4 your_script.py (so that nodes x processes per node "
                         "is a multiple of 4)",
}
FOREIGN_MISTAKES = {  # the user's code's and TRL's own errors
    "reward_signature": "TypeError: reward_of_one_completion() got an unexpected keyword argument 'prompts'",
    "trl_refusal": "ValueError: generation_batch_size (4) must be divisible by num_generations (3).",
    "user_name_error": "NameError: name 'prompts' is not defined",
}
TORCHRUN = "torch/distributed/elastic/"  # in every line torchrun's agent logs


def rank_output(node_log: str) -> list[str]:
    """What the node's only rank printed: the node's output up to torchrun's own failure report."""
    lines = node_log.splitlines()
    end = next((i for i, line in enumerate(lines) if "torch/distributed/elastic" in line), len(lines))
    return lines[:end]


def test_a_package_error_on_one_rank_is_one_line_on_each_terminal_naming_it(tmp_path):
    model = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "model"))
    tmp = tmp_path / "tmp"  # where tempfile puts the tracebacks in the ranks
    tmp.mkdir()
    result = launch("fatal_line.py", ["--model", model, "--out", str(tmp_path / "out")], tmp_path / "launch",
                    nnodes=2, nproc_per_node=1, timeout=240, env={"TMPDIR": str(tmp)})
    assert not result.timed_out and result.returncodes == [1, 1], result.describe()
    outputs = [rank_output(log) for log in result.logs]  # node i runs rank i
    for rank, lines in enumerate(outputs):
        assert 1 <= len(lines) <= 3, (rank, result.describe())
        assert "ModelStructureError" in lines[0], (rank, lines)
        assert "Traceback" not in "\n".join(lines) and "[rank" not in "\n".join(lines), (rank, lines)
    (directory,) = list(tmp.glob("twinkle-errors-*"))
    assert outputs[1][0] == f"twinkle_strategy: rank 1: {INJECTED} (traceback: {directory}/rank1.txt)"
    # Rank 0's own error is the lost connection; its line names the cause instead.
    assert outputs[0][0] == (f"twinkle_strategy: rank 0 stopped because rank 1 failed: {INJECTED} "
                             f"(tracebacks: {directory}/rank<R>.txt)")
    failing = (directory / "rank1.txt").read_text()
    assert failing.startswith("rank 1 of 2 (node 1), pid ") and "Traceback (most recent call last)" in failing
    assert "in on_step_begin" in failing and failing.rstrip().endswith(INJECTED)
    stranded = (directory / "rank0.txt").read_text()
    assert "all_gather" in stranded and "Connection closed by peer" in stranded, stranded[-2000:]


def rounds_output(node_log: str) -> tuple[list[list[str]], list[str]]:
    """The workers' output of each torchrun round (the lines between the agent's own), and torchrun's closing
    report (its ChildFailedError, from the traceback that raises it)."""
    lines = node_log.splitlines()
    raised = next(i for i, line in enumerate(lines) if "ChildFailedError" in line)
    end = max(i for i in range(raised) if lines[i] == "Traceback (most recent call last):")
    rounds, current = [], []
    for line in lines[:end]:
        if TORCHRUN in line:
            if current:
                rounds.append(current)
            current = []
        else:
            current.append(line)
    return rounds + ([current] if current else []), lines[end:]


def test_each_usual_mistake_in_a_user_script_is_one_line_or_one_traceback(tmp_path):
    """Issue 47: R3x (66 lines before), a reward function with the wrong signature (151), a misspelt routing_reply=
    (70), ep_size=4 on 2 ranks (its line, then torchrun's 40), TRL's own refusal, a NameError in the script."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # Fresh ranks, not forked (tests/preload.py): torchrun's SIGTERM to the round's other rank reaches a forked one
    # through its client, later under load, and in that time the rank can print c10's TCPStore warning (with its
    # C++ backtrace) into the round's output (2 failures in 13 runs forked, 2 concurrent; none fresh).
    result = launch("user_mistakes.py", ["--out", str(tmp_path / "out")], tmp_path / "launch", nnodes=1,
                    nproc_per_node=2, timeout=600, env={"TMPDIR": str(tmp)}, max_restarts=5, preloaded=False)
    assert not result.timed_out and result.returncodes == [1], result.describe()
    rounds, report = rounds_output(result.logs[0])
    assert len(rounds) == 6, result.describe()
    directories = sorted(tmp.glob("twinkle-errors-*"), key=lambda d: d.stat().st_mtime)  # one per round
    for lines, (mistake, error) in zip(rounds[:3], PACKAGE_MISTAKES.items(), strict=True):
        assert len(lines) == 1, (mistake, lines)  # both ranks raise it: one line for the node
        assert any(lines[0] == f"twinkle_strategy: rank {rank}: {error} (traceback: {directory}/rank{rank}.txt)"
                   for rank in (0, 1) for directory in directories), (mistake, lines)
    for lines, (mistake, error) in zip(rounds[3:], FOREIGN_MISTAKES.items(), strict=True):
        text = "\n".join(lines)
        assert lines[0].startswith("twinkle_strategy: rank ") and lines[0].endswith("/rank<R>.txt):"), (mistake, text)
        assert lines[1] == "Traceback (most recent call last):" and lines[-1] == error, (mistake, text)
        assert text.count("Traceback (most recent call last)") == 1 and "[rank" not in text, (mistake, text)
        assert "tests/workers/user_mistakes.py" in text, (mistake, text)  # where the user's script called it
    # torchrun's report names the last round's line for each failed rank, not a link to its docs.
    assert "traceback : twinkle_strategy: rank " in "\n".join(report), "\n".join(report)
    assert "To enable traceback see" not in "\n".join(report)
