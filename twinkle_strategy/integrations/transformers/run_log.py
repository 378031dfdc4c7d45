"""A trainer's log lines in ``output_dir/logging.jsonl``, and where its results are, printed when training ends.

The same file twinkle-sft writes in its run directory (:mod:`twinkle_strategy.step.run_files`): each line HF's
``log_history`` entry (HF's and TRL's fields, the strategy's tokens, throughput and expert load, ``step``),
appended by process zero as it is logged. A resumed run starts the file again from the checkpoint's history, so
that lines a stopped run logged after its checkpoint are not read twice. When training ends, process zero prints
the output directory, the last checkpoint and the log file. ms-swift's trainers write and print their own
(:class:`RunLog` is off there).
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from twinkle_strategy.step.run_files import append_log, log_path, rewrite_log, where_results_are


class RunLog(TrainerCallback):
    """``logging.jsonl`` in ``args.output_dir`` and, at the end of training, where the results are (process zero)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # (a resumed run: its history up to the checkpoint; a new one: empty)
            rewrite_log(args.output_dir, state.log_history)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and state.log_history:
            append_log(args.output_dir, state.log_history[-1])  # the entry HF has just recorded, with its step

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(where_results_are(run_directory=args.output_dir, last_checkpoint=get_last_checkpoint(args.output_dir),
                                    log_file=log_path(args.output_dir)), flush=True)
