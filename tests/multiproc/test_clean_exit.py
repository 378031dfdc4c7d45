"""A user's script that ends without ``strategy.shutdown()`` exits 0, every time (issue 47).

Found: after a run whose training and checkpoint were complete, one rank sometimes died with ``terminate called
without an active exception`` (SIGABRT) and torchrun reported the job failed. A gloo worker thread releases a
collective's tensors just after the rank's ``wait()`` returned; their Python objects need the GIL, and a worker
the scheduler delays past the script's end asks for it while the interpreter finalises, which ends the thread with
a forced unwind that cannot cross the work's destructor (a core dump shows ``ProcessGroupGloo::runLoop`` ->
``~AsyncWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``). The strategy
now destroys the process group it made, and waits for gloo's workers to settle, from an ``atexit`` hook
(twinkle_strategy.distributed.teardown).

One launch of 2 ranks (tests/workers/clean_exit.py, not forked from the preload server: its ranks end by
``os._exit``, which never finalises) forks, per rank, a child for each run of a GRPO script and an SFTTrainer
script, twice each, and of a script whose last act is a collective on a gloo group made beside the process group
(where the abort is likeliest: 5 of 10 bare-torch launches of 4 ranks aborted on this machine), six times; the
children end through the interpreter's own finalisation. Every child must exit 0. The
scripts pass no ``use_cpu``: TRL must count both ranks (``generation_batch_size`` 8 = 2 x 4), a config made before
the strategy set up is refused in one line naming ``use_cpu``, and the SFT run leaves its ``logging.jsonl`` and
prints where its results are.
"""

from __future__ import annotations

import json

from multinode import launch

RUNS = 2  # of each training script
COLLECTIVE_RUNS = 6  # of a script whose last act is a collective on a side gloo group: ~2 s each, the likeliest abort


def test_scripts_without_shutdown_exit_zero_every_time(tmp_path):
    result = launch("clean_exit.py", ["--runs", str(RUNS), "--collective-runs", str(COLLECTIVE_RUNS)], tmp_path, nnodes=1, nproc_per_node=2, timeout=600,
                    preloaded=False)
    assert result.ok(), result.describe()
    runs = [f"{kind}{index}" for index in range(RUNS) for kind in ("grpo", "sft")]
    every_run = [f"{kind}{index}" for index in range(max(RUNS, COLLECTIVE_RUNS))
                 for kind in ("grpo", "sft", "collectives") if index < (COLLECTIVE_RUNS if kind == "collectives" else RUNS)]
    for rank, data in result.rank_results().items():
        assert data.get("done") and [e["run"] for e in data["exits"]] == every_run, (rank, data)
        assert all(e["exit"] == 0 for e in data["exits"]), (rank, data["exits"], result.describe())
    log = "\n".join(result.logs)
    assert "terminate called" not in log, result.describe()
    for run in runs:
        seen = [json.loads((tmp_path / f"{run}.rank{rank}.json").read_text()) for rank in (0, 1)]
        assert all(s["use_cpu"] for s in seen), (run, seen)  # set by with_strategy on a CPU strategy
        if run.startswith("grpo"):
            assert all(s["generation_batch_size"] == 8 and s["steps"] == [1, 2] for s in seen), (run, seen)
        else:
            assert all(s["steps"] == [1, 2] for s in seen), (run, seen)
            lines = [json.loads(line) for line in (tmp_path / run / "logging.jsonl").read_text().splitlines()]
            assert [line["step"] for line in lines if "loss" in line] == [1, 2], lines
            assert (f"run directory: {tmp_path / run}\nlast checkpoint: {tmp_path / run / 'checkpoint-2'}\n"
                    f"log: {tmp_path / run / 'logging.jsonl'}") in log, log[-4000:]
    early = [json.loads((tmp_path / f"grpo0.rank{rank}.json").read_text())["early_config"] for rank in (0, 1)]
    assert all(e is not None and "use_cpu=True" in e and "counts 1 process(es) but the strategy runs 2" in e
               for e in early), early
