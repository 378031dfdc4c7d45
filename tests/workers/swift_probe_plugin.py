"""Test-only ms-swift plugin: after training, record what the twinkle plugin did on each rank.

Passed to ``swift sft`` next to the twinkle plugin (``--external_plugins <twinkle> <this>
--callbacks twinkle_probe``). At the end of training every rank runs the distributed (EP + FSDP2)
model on fixed token ids; rank 0 writes the logits to ``$TWINKLE_PROBE_OUT/logits.pt``, and each
rank writes ``rank<R>.json`` (whether it read the checkpoint, its memory_efficient_init report).
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


class TwinkleProbe(TrainerCallback):

    def on_train_end(self, args, state, control, **kwargs):
        from twinkle_strategy.integrations.swift import plugin as swift_plugin

        out = os.environ["TWINKLE_PROBE_OUT"]
        os.makedirs(out, exist_ok=True)
        strategy = swift_plugin.get_strategy()
        model = self.trainer.model
        logits = probe_logits(model, strategy.device)
        report = strategy.init_report
        info = {"rank": strategy.rank, "loaded_checkpoint": swift_plugin._STATE.get("loaded_checkpoint"),
                "is_source": strategy.topology.is_source, "ep_size": strategy.ep_size,
                "init_report": dataclasses.asdict(report) if report is not None else None,
                "model_class": type(model).__name__}
        with open(os.path.join(out, f"rank{strategy.rank}.json"), "w") as f:
            json.dump(info, f, indent=1)
        if strategy.rank == 0:
            torch.save({"input_ids": torch.tensor(PROBE_IDS), "logits": logits}, os.path.join(out, "logits.pt"))


callbacks_map["twinkle_probe"] = TwinkleProbe
