"""One message, not a wall, in one process: which rank says what when a package error ends a job (ranks sharing a
real TCPStore as torchrun's workers share the agent's), and twinkle-sft's summary order. The launch that shows the
lines on real terminals is tests/multiproc/test_fatal_errors.py."""

from __future__ import annotations

import datetime
import io
import os
import re
import tempfile
import time

import pytest
import torch.distributed as dist

from twinkle_strategy.distributed.fatal_errors import ErrorBoard, RankPlace, report
from twinkle_strategy.errors import (
    CheckpointError,
    ConflictingShardingError,
    DistributedInitError,
    ModelStructureError,
    TrainingAbortedError,
)

PEER_GONE = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11190. This is "
                         "typically caused by a remote worker crashing.")


def raised(exc: Exception) -> Exception:
    """``exc`` with a traceback, as the hook receives it."""
    try:
        raise exc
    except Exception as caught:  # noqa: BLE001
        return caught


# --------------------------------------------------------------------- which rank says what, in one process
@pytest.fixture
def board(tmp_path, monkeypatch):
    """The job's error board on a real TCPStore; tracebacks under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=7))
    return ErrorBoard(store, "twinkle/errors/0", "job")


def said(board: ErrorBoard, exc: Exception, rank: int, node: int) -> str:
    """What rank ``rank`` of 4 (2 nodes x 2) prints when ``exc`` ends it."""
    out = io.StringIO()
    assert report(raised(exc), RankPlace(rank=rank, world_size=4, node_rank=node), out=out, board=board)
    return out.getvalue()


def test_the_cause_is_said_once_per_node_and_stranded_ranks_name_it(board):
    cause = ModelStructureError("router_aux_loss_coef: the model's loss is another form")
    tracebacks = board.traceback_path("<R>")
    assert said(board, cause, rank=1, node=0) == (f"twinkle_strategy: rank 1: ModelStructureError: {cause} "
                                                  f"(traceback: {board.traceback_path(1)})\n")
    assert said(board, PEER_GONE, rank=0, node=0) == ""  # node 0's terminal has the cause already
    assert said(board, PEER_GONE, rank=2, node=1) == (f"twinkle_strategy: rank 2 stopped because rank 1 failed: "
                                                      f"ModelStructureError: {cause} (tracebacks: {tracebacks})\n")
    abort = TrainingAbortedError("step2 failed on rank 3: rank 1 failed: ModelStructureError: ...")
    assert said(board, abort, rank=3, node=1) == ""
    for rank in range(4):
        assert "Traceback (most recent call last)" in open(board.traceback_path(rank)).read()
    assert "Connection closed by peer" in open(board.traceback_path(0)).read()


def test_a_fail_together_error_is_one_line_per_node(board):
    error = DistributedInitError("memory_efficient_init failed on rank(s) [1]: rank 1: CheckpointError: "
                                 "model.layers.1.mlp.gate.weight is [3, 3] in the checkpoint", [(1, "...")])
    lines = [said(board, error, rank=rank, node=rank // 2) for rank in (1, 0, 3, 2)]
    expected = f"twinkle_strategy: every rank stopped: DistributedInitError: {error} (tracebacks: " \
               f"{board.traceback_path('<R>')})\n"
    assert lines == [expected, "", expected, ""]


def test_a_refusal_every_rank_makes_is_one_line_per_node(board):
    refusal = ConflictingShardingError("TrainingArguments.deepspeed: the strategy shards the model; drop it")
    lines = [said(board, refusal, rank=rank, node=rank // 2) for rank in range(4)]
    assert lines[1] == lines[3] == "" and lines[0].startswith("twinkle_strategy: rank 0: ConflictingShardingError: ")
    assert lines[2].startswith("twinkle_strategy: rank 2: ConflictingShardingError: ")


def test_a_lost_connection_nobody_explains_keeps_its_traceback(board, tmp_path):
    """No error recorded: a lost connection, and Ctrl-C, go to the previous hook."""
    place = RankPlace(rank=0, world_size=4, node_rank=0)
    assert not report(raised(PEER_GONE), place, out=io.StringIO(), board=board)
    assert not report(KeyboardInterrupt(), place, out=io.StringIO(), board=board)
    assert not os.path.exists(board.traceback_path(0))
    # A package error that names no peer's record is said by its own rank.
    out = io.StringIO()
    assert report(raised(CheckpointError("model.safetensors: truncated")), place, out=out, board=board)
    assert out.getvalue().startswith("twinkle_strategy: rank 0: CheckpointError: model.safetensors: truncated")


def test_a_foreign_error_is_its_traceback_once_per_node_and_one_line_where_it_stranded_a_rank(board):
    """A user's (or TRL's) own error (issue 47: a reward function with the wrong signature printed 151 lines): its
    traceback once per node, said without waiting, and the ranks it stranded name it in one line."""
    bug = KeyError("a user's bug")
    start = time.monotonic()
    first = said(board, bug, rank=1, node=0)
    assert time.monotonic() - start < 1  # only a stranded rank waits for its peer's record
    lines = first.splitlines()
    assert lines[0] == f"twinkle_strategy: rank 1 failed; its traceback (every rank's: {board.traceback_path('<R>')}):"
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == 'KeyError: "a user\'s bug"', first
    assert first.count("Traceback (most recent call last)") == 1 and "[rank" not in first
    assert said(board, bug, rank=0, node=0) == ""  # the same error on the same node: said already
    assert said(board, PEER_GONE, rank=2, node=1) == (f"twinkle_strategy: rank 2 stopped because rank 1 failed: "
                                                      f"KeyError: \"a user's bug\" (tracebacks: "
                                                      f"{board.traceback_path('<R>')})\n")
    assert said(board, bug, rank=3, node=1) == ""  # node 1's terminal names it already
    for rank in range(4):
        assert "Traceback (most recent call last)" in open(board.traceback_path(rank)).read()


def test_torchruns_failure_report_gets_the_ranks_line(board, tmp_path, monkeypatch):
    """Under torchrun each failed rank writes its line where torchrun's agent reads the worker's failure from, as
    its ``@record`` would: torchrun's report then shows the line, not a link to its docs."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    refusal = ConflictingShardingError("TrainingArguments.deepspeed: drop it")
    line = said(board, refusal, rank=0, node=0)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["extraInfo"]["py_callstack"] == line.rstrip("\n")
    assert said(board, KeyError("late"), rank=1, node=0) == ""  # a peer's error came first: rank 1 names it
    assert ProcessFailure(local_rank=1, pid=2, exitcode=1, error_file=str(error_file)).message["message"] == (
        f"twinkle_strategy: rank 1 stopped because rank 0 failed: ConflictingShardingError: {refusal} "
        f"(tracebacks: {board.traceback_path('<R>')})")


def test_without_a_store_each_rank_says_its_own_line(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    board = ErrorBoard(None, "twinkle/errors/0", "nostore")
    assert said(board, ModelStructureError("x"), rank=1, node=0).startswith("twinkle_strategy: rank 1: ")
    start = time.monotonic()
    assert said(board, TrainingAbortedError("step1 failed on rank 0: y"), rank=0, node=0).startswith(
        "twinkle_strategy: rank 0: TrainingAbortedError: step1 failed on rank 0: y")
    assert time.monotonic() - start < 1


def test_the_hook_installed_before_and_after_torchs_reports_once(tmp_path, monkeypatch, capsys):
    """from_pretrained installs it before the process group (its refusals come first), init_distributed again after
    torch wrapped it in its own: a package error is one line, any other error reaches Python's hook once."""
    import sys

    from twinkle_strategy.distributed import fatal_errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls, original_report = [], fatal_errors.report
    monkeypatch.setattr(sys, "excepthook", lambda *args: calls.append("python"))
    monkeypatch.setattr(fatal_errors, "report", lambda *args: calls.append("report") or original_report(*args))
    place = RankPlace(rank=1, world_size=2, node_rank=0)
    fatal_errors.install(place)  # no process group: no store, so each rank says its own line
    inner = sys.excepthook

    def torch_hook(*args):  # what init_process_group installs: the hook it found, its output prefixed
        calls.append("torch")
        inner(*args)

    monkeypatch.setattr(sys, "excepthook", torch_hook)
    fatal_errors.install(place)
    fatal_errors.install(place)  # idempotent
    lost = raised(PEER_GONE)  # no peer recorded why: Python's hook shows it
    sys.excepthook(type(lost), lost, lost.__traceback__)
    assert calls == ["report", "torch", "python"]  # looked at once, by the outer hook
    calls.clear()
    error = raised(KeyError("a user's bug"))  # the user's own error: its traceback, said by the outer hook
    sys.excepthook(type(error), error, error.__traceback__)
    assert calls == ["report"]
    assert capsys.readouterr().err.startswith("twinkle_strategy: rank 1 failed; its traceback (every rank's: ")
    calls.clear()
    refusal = raised(ConflictingShardingError("TrainingArguments.deepspeed: drop it"))
    sys.excepthook(type(refusal), refusal, refusal.__traceback__)
    assert calls == ["report"]
    assert capsys.readouterr().err.startswith("twinkle_strategy: rank 1: ConflictingShardingError: "
                                              "TrainingArguments.deepspeed: drop it (traceback: ")


# ------------------------------------------------------------------------------- twinkle-sft's summary
def test_twinkle_sft_summary_puts_the_cause_first(tmp_path):
    """The order of the issue's run: the ranks the cause stranded failed (and recorded) before the cause's own
    record was the earliest; the summary still leads with the cause and shows its traceback."""
    from twinkle_strategy.train.rank_logs import failure_summary, record_error

    os.makedirs(tmp_path / "logs")
    cause = "router_aux_loss_coef: Qwen3MoeForCausalLM's load-balancing loss (2.39) is not the Switch-Transformer form"
    record_error(str(tmp_path), 0, raised(TrainingAbortedError(f"step1 failed on rank 0: rank 1 failed: "
                                                               f"ModelStructureError: {cause}. Underlying error: ...")))
    record_error(str(tmp_path), 2, raised(PEER_GONE))
    record_error(str(tmp_path), 1, raised(ModelStructureError(cause)))
    record_error(str(tmp_path), 3, raised(ModelStructureError(cause.replace("2.39", "2.22"))))
    summary = failure_summary(str(tmp_path), [0, 1, 2, 3], [0, 1])
    lines = summary.splitlines()
    assert lines[0] == "twinkle-sft: the run failed; 4 of 4 ranks raised an error:"
    assert lines[1:6] == [f"  ModelStructureError: {cause}", "    raised on rank(s) [1]",
                          f"  ModelStructureError: {cause.replace('2.39', '2.22')}", "    raised on rank(s) [3]",
                          "  rank(s) [0, 2] stopped because of the error(s) above (RuntimeError, TrainingAbortedError; see their logs)"]
    assert lines[6] == "Traceback of rank 1, the first to fail:"
    assert summary.count("Traceback (most recent call last)") == 1 and "Connection closed" not in summary
    assert re.search(r"Every rank's full output: .*rank<R>\.log \(ranks 0-3\)", summary)
