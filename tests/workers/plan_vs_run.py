"""Train a few steps of each named configuration and record the tensor memory each rank really held.

Per configuration and rank: the peak of live tensor bytes during the init (from the start to the
first step) and during the steps (every storage alive, parameters included, as a device's allocator
counts them), with :class:`alloc_tracker.LiveBytes`. The test plans the same configurations in its
own process and compares. One launch serves every configuration: each builds its own strategy and
joins the process group the first one started.
"""

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import worker_common  # noqa: E402
from alloc_tracker import LiveBytes  # noqa: E402

from twinkle_strategy.train.recipe import load_recipe  # noqa: E402
from twinkle_strategy.train.run import build_training  # noqa: E402

STEPS = 2


@contextlib.contextmanager
def node_shape(nproc_per_node: int):
    """The launch's ranks regrouped into nodes of ``nproc_per_node`` (torchrun's variables, as a launch of that
    shape sets them): one launch of 4 ranks serves 2x2 and 1x4 configurations. Each strategy reads them anew."""
    keys = ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_WORLD_SIZE=str(nproc_per_node), LOCAL_RANK=str(rank % nproc_per_node),
                      GROUP_RANK=str(rank // nproc_per_node))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(overrides: list[str]) -> dict:
    start = time.monotonic()
    recipe = load_recipe(None, overrides)
    tracker = LiveBytes()
    with node_shape(recipe.launch.nproc_per_node), tracker:
        trainer, strategy = build_training(recipe, print_summary=False)
        marks = {}
        original = trainer.training_step

        def training_step(step):
            if not marks:  # the init is over: wrapped, materialized, optimizer made
                marks["init_peak"], marks["init_at_peak"] = tracker.peak, tracker.at_peak[:8]
                tracker.mark()
            result = original(step)
            marks["step_peak"], marks["step_at_peak"] = tracker.peak, tracker.at_peak[:8]  # after each step: the final save's memory is not the step's
            return result

        trainer.training_step = training_step
        trainer.train()  # (the process group stays up: the next configuration's strategy joins it)
    report = strategy.init_report
    return {"init_peak": marks["init_peak"], "step_peak": marks["step_peak"],
            "is_source": bool(report and report.is_source),
            "nodes": [strategy.topology.num_nodes, strategy.topology.local_world_size],
            "init_at_peak": marks["init_at_peak"], "step_at_peak": marks["step_at_peak"],
            "init_shard_bytes": report.shard_bytes + report.buffer_bytes if report else None,
            "seconds": time.monotonic() - start}  # what each configuration adds to the launch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--common", nargs="*", default=[])
    p.add_argument("--config", action="append", required=True, help="NAME:key=value;key=value")
    args = p.parse_args()
    out = {}
    for spec in args.config:
        name, _, keys = spec.partition(":")
        out[name] = measure(list(args.common) + [k for k in keys.split(";") if k] + [f"train.max_steps={STEPS}"])
    return {"configs": out}


if __name__ == "__main__":
    worker_common.run(main)
