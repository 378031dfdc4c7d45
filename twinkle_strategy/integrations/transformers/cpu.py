"""A CPU strategy as transformers and TRL see it: every rank of the job, without the user passing ``use_cpu=True``.

On a machine without a GPU, ``TrainingArguments`` asks accelerate for the world when it first needs it (TRL's
``GRPOConfig`` does so while it is built, to size ``generation_batch_size``). Unless told the job runs on the CPU
(``use_cpu=True``, or ``ACCELERATE_USE_CPU``), accelerate counts one process although the process group holds
more: TRL then refuses ``generation_batch_size (4) must be divisible by num_generations (8)`` at 2 ranks x 4, and a
Trainer would draw every rank's batches as if it were alone. The strategy's setup on the CPU exports
``ACCELERATE_USE_CPU`` (:func:`twinkle_strategy.distributed.runtime.tell_accelerate_the_device`), so that arguments
made after it see every rank; :func:`serve_cpu` then makes the trainer's arguments say so (``use_cpu``), and
refuses in one line arguments made before the strategy set up, whose world is already counted wrong.
"""

from __future__ import annotations

from twinkle_strategy.errors import ParallelConfigError


def serve_cpu(training_args, strategy) -> None:
    """On a CPU strategy: ``training_args`` (a ``TrainingArguments``, TRL's configs included; None: the trainer makes
    its own) as ``use_cpu=True`` would have made them, or :class:`ParallelConfigError` when they count another world
    than the strategy's. Nothing on a GPU or NPU."""
    strategy.setup()  # (idempotent) the process group, and ACCELERATE_USE_CPU for arguments made from now on
    if strategy.device_type != "cpu" or training_args is None:
        return
    counted = training_args.world_size  # accelerate's count, made when the arguments first asked for it
    if counted != strategy.world_size:
        raise ParallelConfigError(
            f"{type(training_args).__name__} counts {counted} process(es) but the strategy runs {strategy.world_size} "
            f"on the CPU: pass use_cpu=True to {type(training_args).__name__}(...), or make it after "
            "strategy.from_pretrained(...) (or strategy.setup())")
    # What use_cpu=True sets when the arguments are made: nothing to pin memory for (torch warns on every rank).
    training_args.use_cpu = True
    training_args.dataloader_pin_memory = False
