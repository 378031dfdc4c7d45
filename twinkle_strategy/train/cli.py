"""``twinkle-sft``: train from a YAML recipe and/or ``swift sft``-style flags.

    twinkle-sft yaml/demo.yaml train.max_steps=20
    twinkle-sft --model /models/Qwen3-30B-A3B --dataset data.jsonl --tuner_type lora \\
                --expert_parallel_size 8 --memory_efficient_init true --output_dir output
    NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 twinkle-sft ...

Flags keep the names of ``swift sft``; each maps to one recipe key (see
``--help``), and ``key=value`` overrides any recipe key (it wins over a flag).
The recipe, flags and ``key=value`` come in any order; ``--max-steps`` is
``--max_steps`` and ``--max_steps=3`` is ``--max_steps 3``; a flag is never
guessed from a prefix. A swift flag twinkle-sft does not take is refused with
the reason, any other unknown flag with the nearest one. Like swift, when
NPROC_PER_NODE (and NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT for several
nodes) are set, the command re-launches itself under torchrun.

Before any process or process group starts, the recipe is validated and its paths
are checked on this machine: the dataset files and their first rows, the model
directory (or an hf:// / ms:// id already in the local cache), the output directory.
A problem is one line naming the key and flag, exit status 2, nothing written.

A multi-process run writes every rank's output to <run dir>/logs/rank<R>.log and
shows the first rank here; if it fails, it ends with one summary: each distinct
error once with the ranks that raised it, and the first failing rank's traceback.

Data: JSONL rows with 'messages', or 'query' and 'response'. As with swift's default
--strict false, a row that cannot become an example (not JSON, no assistant turn,
longer than --max_length under swift's default --truncation_strategy delete) is
skipped, with one warning naming the lines; --strict true stops at the first.
--dataset a.jsonl b.jsonl#1000 is all of a.jsonl and 1000 examples of b.jsonl
(swift's #N: whole copies of the file while N exceeds it, then a random subset
seeded with --seed).

Models: a local directory, hf://org/name (huggingface_hub; HF_HUB_OFFLINE=1 uses
only the cache under HF_HOME) or ms://org/name (modelscope; a snapshot already under
MODELSCOPE_CACHE is used without network access). A bare org/name is taken as swift
takes it: a local path of that name if one exists, else from ModelScope, or from the
Hugging Face Hub with --use_hf true (or USE_HF=1 when --use_hf is not given). With
--memory_efficient_init true only each node's local rank 0 resolves and reads it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from collections.abc import Callable

from twinkle_strategy import log
from twinkle_strategy.checkpoint import latest_checkpoint
from twinkle_strategy.errors import TwinkleError
from twinkle_strategy.step.run_files import log_path, where_results_are
from twinkle_strategy.train.errors import RunStoppedError
from twinkle_strategy.train.fit_check import UserSpelling, check_fit_before_launch, plan_command

# The command line's reading lives in .flags; SWIFT_FLAGS, build_parser and split_argv are named here too (tests).
from twinkle_strategy.train.flags import SWIFT_FLAGS, build_parser, check_value, flag_for, parse, split_argv  # noqa: F401
from twinkle_strategy.train.launcher import device_problem, run_logged, waiting_line
from twinkle_strategy.train.ports import master_port_problem, on_a_free_port
from twinkle_strategy.train.preflight import check_before_launch
from twinkle_strategy.train.rank_logs import RUN_DIR_ENV, capture_rank_output, logs_dir, record_error
from twinkle_strategy.train.recipe import Recipe, RecipeError
from twinkle_strategy.train.run import prepare_model_path, run_recipe
from twinkle_strategy.train.run_dir import make_run_dir
from twinkle_strategy.train.start_time import LaunchClock
from twinkle_strategy.train.torchrun import cli_rank_program, torchrun_command
from twinkle_strategy.train.versions import startup_line, version_text


def _launch_torchrun(argv: list[str], recipe: Recipe) -> int | None:
    """Re-launch under torchrun like swift (NPROC_PER_NODE, NNODES, ...); None to train in this process."""
    env = os.environ
    nproc = int(env.get("NPROC_PER_NODE", recipe.launch.nproc_per_node))
    nnodes = int(env.get("NNODES", recipe.launch.nnodes))
    if nproc * nnodes == 1:
        return None
    node_rank = int(env.get("NODE_RANK", "0"))
    ranks = list(range(node_rank * nproc, (node_rank + 1) * nproc))  # torchrun numbers ranks node by node
    if nnodes == 1 and "MASTER_PORT" not in env:  # one node, no port named: pick one, as torchrun --standalone
        return _run_logged(lambda port: [torchrun_command(cli_rank_program(argv), 1, 0, nproc,
                                                          port, max_restarts=recipe.launch.max_restarts)],
                           recipe, ranks, [0], f"torchrun, {nproc} ranks on this node")
    port, master_addr = int(env.get("MASTER_PORT", "29500")), env.get("MASTER_ADDR", "127.0.0.1")
    if node_rank == 0 and (problem := master_port_problem(port)):
        print(f"twinkle-sft: error: {problem}", file=sys.stderr)
        return 2
    cmd = torchrun_command(cli_rank_program(argv), nnodes, node_rank, nproc,
                           port, master_addr=master_addr, max_restarts=recipe.launch.max_restarts)
    waiting = waiting_line(nnodes, node_rank, nproc, master_addr, port) if nnodes > 1 else None
    return _run_logged([cmd], recipe, ranks, [node_rank], f"torchrun, {nproc} ranks on this node", waiting)


def main(argv: list[str] | None = None) -> int:
    # The start line's clock: the command's own start (Python's start-up counts), or this call's from Python.
    clock = LaunchClock.of_this_process() if argv is None else LaunchClock.now()
    argv = list(sys.argv[1:] if argv is None else argv)
    log.apply_level_from_environment()  # read when the program starts, not when the package was imported
    if "--version" in argv:
        print(version_text())
        return 0
    if "--swift-plugin-path" in argv:
        # A path, not an import: importing the plugin would patch ms-swift in this process.
        print(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations", "swift", "plugin.py"))
        return 0
    if "LOCAL_RANK" in os.environ:  # a torchrun worker
        return _worker_main(argv)
    if argv[:1] == ["plan"]:
        return plan_command(argv[1:], parse)
    try:
        return _parse_and_launch(argv, clock)
    except RunStoppedError as exc:  # SIGTERM / SIGINT during a launched run: every process has ended
        print(f"twinkle-sft: {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("twinkle-sft: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


def _parse_and_launch(argv: list[str], clock: LaunchClock) -> int:
    try:
        recipe = parse(argv)
        check_before_launch(recipe)
    except (RecipeError, TwinkleError) as exc:
        print(f"twinkle-sft: error: {_describe(exc)}", file=sys.stderr)
        return 2
    if problem := device_problem(recipe.strategy.device_type, recipe.strategy.backend):
        print(f"twinkle-sft: error: {problem}", file=sys.stderr)
        return 2

    # Build the embedded model (tiny://) once here, before any worker starts; the workers find it built.
    recipe.model.path = prepare_model_path(recipe.model.path, recipe.data.dataset)
    try:
        with clock.planning():
            refusal = check_fit_before_launch(recipe, spelling=UserSpelling.of_argv(argv))  # the user's words
    except TwinkleError as exc:
        refusal = f"the memory plan failed: {exc}; --skip_plan true launches without it"
    if refusal:
        print(f"twinkle-sft: error: {refusal}", file=sys.stderr)
        return 2
    with clock.handed_over():
        if recipe.launch.simulated_nodes and recipe.launch.nnodes > 1:
            return _launch_simulated_nodes(argv, recipe)
        code = _launch_torchrun(argv, recipe)
        if code is not None:
            return code
        print(startup_line(), file=sys.stderr, flush=True)
        run_recipe(recipe)  # one process: train here
    return 0


def _describe(exc: Exception) -> str:
    key = getattr(exc, "key", None)
    flag = flag_for(key) if key else None
    return f"{key} ({flag}): {exc.reason}" if flag else str(exc)


@dataclasses.dataclass(frozen=True)
class LaunchShape:
    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def simulated_launch_shape(recipe: Recipe) -> LaunchShape:
    """The simulated nodes to start: as for a real launch (and the world size the recipe was checked
    against, :func:`~twinkle_strategy.train.recipe.planned_world_size`), swift's NNODES/NPROC_PER_NODE win."""
    return LaunchShape(nnodes=int(os.environ.get("NNODES", recipe.launch.nnodes)),
                       nproc_per_node=int(os.environ.get("NPROC_PER_NODE", recipe.launch.nproc_per_node)))


def _launch_simulated_nodes(argv: list[str], recipe: Recipe) -> int:
    shape = simulated_launch_shape(recipe)
    nnodes, nproc = shape.nnodes, shape.nproc_per_node

    def commands(port: int) -> list[list[str]]:
        return [torchrun_command(cli_rank_program(argv), nnodes, node, nproc, port,
                                 max_restarts=recipe.launch.max_restarts) for node in range(nnodes)]

    return _run_logged(commands, recipe, list(range(nnodes * nproc)), list(range(nnodes)),
                       f"{nnodes} simulated nodes x {nproc} ranks on this machine")


def _run_logged(commands: list[list[str]] | Callable[[int], list[list[str]]], recipe: Recipe, ranks: list[int],
                node_ranks: list[int], what: str, waiting: str | None = None) -> int:
    """``commands``: the agents' commands, or a function of the master port for a launch that picks its own
    (:func:`~twinkle_strategy.train.launcher.on_a_free_port`: picked again if another process takes it first)."""
    # Chosen here, not by rank 0, so the logs have a home even if the run fails before training.
    run_dir = make_run_dir(recipe.train.output_dir, recipe.train.add_version)
    if 0 in ranks:  # the node of rank 0, once
        print(startup_line(), file=sys.stderr, flush=True)
    print(f"twinkle-sft: {what}; rank {ranks[0]}'s output follows, every rank's is in {logs_dir(run_dir)}",
          file=sys.stderr, flush=True)
    if callable(commands):
        ok = on_a_free_port(lambda port, retry: run_logged(commands(port), run_dir, ranks, node_ranks, waiting,
                                                           retry_if_port_taken=retry))
    else:
        ok = run_logged(commands, run_dir, ranks, node_ranks, waiting)
    if not ok:
        return 1
    if 0 in ranks:  # with several real nodes, rank 0's node holds the checkpoints; its trainer does not print them
        last = latest_checkpoint(run_dir)
        merged = f"{last}-merged" if last and os.path.isdir(f"{last}-merged") else None
        log_file = log_path(run_dir) if os.path.isfile(log_path(run_dir)) else None
        print(where_results_are(run_directory=run_dir, last_checkpoint=last, log_file=log_file, merged=merged),
              flush=True)
    return 0


def _worker_main(argv: list[str]) -> int:
    """One rank of a run ``twinkle-sft`` launched: log to the run directory, record a failure for the summary."""
    run_dir, rank = os.environ.get(RUN_DIR_ENV), int(os.environ.get("RANK", "0"))
    if run_dir:
        capture_rank_output(run_dir, rank)
    try:
        recipe = parse(argv)
        recipe.model.path = prepare_model_path(recipe.model.path, recipe.data.dataset)
        run_recipe(recipe, run_dir, print_summary=not run_dir)  # a launcher that named run_dir prints it at the end
    except BaseException as exc:
        if not run_dir:
            raise
        record_error(run_dir, rank, exc)
        if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: as Python ends on them
            raise
        # The whole traceback in the rank's log, where the launcher's summary points (the one-line report of
        # distributed.fatal_errors is for a plain torchrun, whose terminal shows every rank's output).
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
