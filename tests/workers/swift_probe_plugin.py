"""Test-only ms-swift plugin: after training, record what the twinkle plugin did on each rank.

Passed to ``swift sft`` next to the twinkle plugin (``--external_plugins <twinkle> <this>
--callbacks twinkle_probe``). At the end of training every rank runs the distributed (EP + FSDP2)
model on fixed token ids; rank 0 writes the logits to ``$TWINKLE_PROBE_OUT/logits.pt``, and each
rank writes ``rank<R>.json`` (whether it read the checkpoint, its memory_efficient_init report).
With an image-text dataset, ``logits.pt`` also holds ``image_text``: the first two training samples
as swift's template and collator make them (token ids, pixel values, image grids), and the model's
logits on them.
With ``TWINKLE_PROBE_LEGACY_STATE=1``, every save also writes what the plugin before its rebuild (git
d5f1785, ``_save_optimizer_and_scheduler``) wrote next to the weights: per-rank ``twinkle_state/rank<R>.pt``
(the local shards of the trainable weights and of the optimizer state) and ``scheduler.pt``, under
``$TWINKLE_PROBE_OUT/legacy/checkpoint-<step>/`` (not into the checkpoint: other tests resume from it).
With ``TWINKLE_ASYNC_SAVE=1``, ``rank<R>.json`` also holds when each step began and when the background writers
wrote each file; with ``TWINKLE_TEST_PAUSE_SAVE_WRITER=checkpoint-<N>:<dir>``, each rank's writer pauses mid-file in
checkpoint-<N> (tests/workers/save_writer_pause.py, installed here in the rank) and process zero releases the paused
writers as step N+1 begins.
With ``TWINKLE_PROBE_BATCHES=1``, ``rank<R>.json`` also holds ``micro_batches``: the token ids of each row (padding
dropped) of every micro-batch the rank trained on, in training order, as ``training_step`` received them.
"""

import dataclasses
import json
import os

import torch
from swift.callbacks import TrainerCallback
from swift.callbacks.mapping import callbacks_map

PROBE_IDS = [[5, 17, 42, 99, 7, 3, 250, 31, 64, 12, 8, 77], [120, 9, 33, 2, 180, 45, 61, 14, 90, 6, 21, 300]]


def probe_logits(model, device) -> torch.Tensor:
    """The model's logits on PROBE_IDS (eval mode, no grad), on CPU in fp32."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROBE_IDS, device=device), use_cache=False).logits.float().cpu()
    model.train()
    return logits


# What the vision-language classes take from swift's collated batch (labels and swift's own keys left out).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def image_text_batch(trainer) -> dict | None:
    """The first two training samples, encoded by swift's template and collated; None for text-only data."""
    samples = [trainer.train_dataset[i] for i in range(2)]
    if "pixel_values" not in samples[0]:
        return None
    batch = trainer.data_collator(samples)
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS and v is not None}


def probe_image_text(trainer, model, device) -> dict | None:
    """``{"inputs": ..., "logits": ...}`` of the model on ``image_text_batch`` (eval mode, no grad), on CPU."""
    batch = image_text_batch(trainer)
    if batch is None:
        return None
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False).logits.float().cpu()
    model.train()
    return {"inputs": batch, "logits": logits}


def write_legacy_state(directory: str, model, optimizer, scheduler) -> None:
    """The old plugin's per-rank resume state, as it wrote it (same world size and ep_size to resume)."""
    from twinkle_strategy.compat.transformers_internals import scheduler_file_name
    from twinkle_strategy.distributed.dtensor import local_tensor
    from twinkle_strategy.integrations.swift import plugin as swift_plugin

    strategy = swift_plugin.get_strategy()
    optimizer_state = optimizer.state_dict()
    local = {
        "layout": {"world_size": strategy.world_size, "ep_size": strategy.ep_size},
        "params": {n: local_tensor(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad},
        "optimizer": {
            "state": {i: {k: local_tensor(v).clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for i, s in optimizer_state["state"].items()},
            "param_groups": optimizer_state["param_groups"],
        },
    }
    os.makedirs(os.path.join(directory, "twinkle_state"), exist_ok=True)
    torch.save(local, os.path.join(directory, "twinkle_state", f"rank{strategy.rank}.pt"))
    if strategy.rank == 0:
        torch.save(scheduler.state_dict(), os.path.join(directory, scheduler_file_name()))


class TwinkleProbe(TrainerCallback):
    step_starts: dict = {}

    def __init__(self, args, trainer):
        super().__init__(args, trainer)
        self.micro_batches = []
        # The writer pause the test asks for, in this rank: ms-swift loads this file by path, so its folder is put on
        # sys.path for the pause's module. It lasts until training ends (on_train_end).
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from save_writer_pause import pause_from_environment

        self.writer_pause = pause_from_environment()
        self.writer_pause.__enter__()
        if os.environ.get("TWINKLE_PROBE_BATCHES") == "1":  # the examples of each micro-batch, as the trainer got them
            training_step = trainer.training_step

            def recording_training_step(model, inputs, *rest, **kwargs):
                ids = inputs["input_ids"]
                mask = inputs.get("attention_mask")
                mask = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
                self.micro_batches.append([row[keep].tolist() for row, keep in zip(ids, mask, strict=True)])
                return training_step(model, inputs, *rest, **kwargs)

            trainer.training_step = recording_training_step

    def on_step_begin(self, args, state, control, **kwargs):
        import time

        from save_writer_pause import PAUSE_ENV

        self.step_starts[state.global_step + 1] = time.time()
        checkpoint, _, pause = os.environ.get(PAUSE_ENV, "").partition(":")
        if checkpoint == f"checkpoint-{state.global_step}" and args.process_index == 0:
            open(os.path.join(pause, "release"), "w").close()  # the writers of the last save go on from here

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if os.environ.get("TWINKLE_PROBE_LEGACY_STATE") == "1":
            write_legacy_state(os.path.join(os.environ["TWINKLE_PROBE_OUT"], "legacy", f"checkpoint-{state.global_step}"),
                               model, optimizer, lr_scheduler)

    def on_train_end(self, args, state, control, **kwargs):
        from twinkle_strategy.integrations.swift import plugin as swift_plugin

        self.writer_pause.__exit__(None, None, None)
        out = os.environ["TWINKLE_PROBE_OUT"]
        os.makedirs(out, exist_ok=True)
        strategy = swift_plugin.get_strategy()
        model = self.trainer.model
        logits = probe_logits(model, strategy.device)
        image_text = probe_image_text(self.trainer, model, strategy.device)
        report = strategy.init_report
        info = {"rank": strategy.rank, "loaded_checkpoint": swift_plugin.STATE.loaded_checkpoint,
                "is_source": strategy.topology.is_source, "ep_size": strategy.ep_size,
                "init_report": dataclasses.asdict(report) if report is not None else None,
                "model_class": type(model).__name__}
        if os.environ.get("TWINKLE_PROBE_BATCHES") == "1":
            info["micro_batches"] = self.micro_batches
        saves = getattr(self.trainer, "async_checkpoints", None)
        if saves is not None:
            info["step_starts"] = self.step_starts
            info["writes"] = {save.name: {name: dataclasses.asdict(t) for name, t in save.write.file_times.items()}
                              for save in saves.saves.finished}
        with open(os.path.join(out, f"rank{strategy.rank}.json"), "w") as f:
            json.dump(info, f, indent=1)
        if strategy.rank == 0:
            torch.save({"input_ids": torch.tensor(PROBE_IDS), "logits": logits, "image_text": image_text},
                       os.path.join(out, "logits.pt"))


callbacks_map["twinkle_probe"] = TwinkleProbe
