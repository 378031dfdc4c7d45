"""One message, not a wall: a package error ends a plain-torchrun job in one line per distinct error, root cause first.

One launch (2 simulated nodes x 1 rank, a user's HF Trainer script under plain torchrun, no try/except): rank 1
raises a ModelStructureError at step 2, which leaves rank 0 in that step's FSDP all-gather until it loses the
peer. Each node's terminal then shows its rank's one line (torchrun's own failure block after it is not
counted), and each rank's traceback is in the file the line names. The rest runs in this process: which rank says
what (ranks sharing a real TCPStore as torchrun's workers share the agent's), and twinkle-sft's summary order:
tests/unit/test_fatal_error_lines.py.
"""

from __future__ import annotations

from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

INJECTED = "ModelStructureError: router_aux_loss_coef: injected on one rank by the test"  # tests/workers/fatal_line.py
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
