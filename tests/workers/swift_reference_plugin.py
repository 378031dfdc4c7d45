"""Test-only ms-swift plugin for the single-process reference run: plain `swift sft`, no twinkle plugin.

    swift sft --external_plugins tests/workers/swift_reference_plugin.py --callbacks twinkle_reference ...

Two things, so that the reference can be compared step by step with the twinkle plugin's runs:
1. it seeds torch with ``--seed`` right before swift applies its tuner, as the twinkle plugin does, so
   both start from the same fresh LoRA adapter (loading the model may consume random numbers);
2. at the end of training it writes the model's logits on the probe's token ids (and, for image-text
   data, on the first two samples) to ``$TWINKLE_PROBE_OUT/logits.pt``, as the probe does for the
   distributed model.
Nothing else of swift is touched: this run is the oracle.
"""

import functools
import os

import torch
from swift.callbacks import TrainerCallback
from swift.callbacks.mapping import callbacks_map
from swift.pipelines.train.tuner import TunerMixin
from swift_probe_plugin import PROBE_IDS, probe_image_text, probe_logits  # swift puts a plugin's folder on sys.path

_prepare_model = TunerMixin.__dict__["prepare_model"].__func__


@classmethod
@functools.wraps(_prepare_model)
def _seeded_prepare_model(cls, args, model, *pargs, **kwargs):
    torch.manual_seed(args.seed)
    return _prepare_model(cls, args, model, *pargs, **kwargs)


TunerMixin.prepare_model = _seeded_prepare_model


class TwinkleReference(TrainerCallback):

    def on_train_end(self, args, state, control, **kwargs):
        out = os.environ["TWINKLE_PROBE_OUT"]
        os.makedirs(out, exist_ok=True)
        model = self.trainer.model
        device = next(model.parameters()).device
        logits = probe_logits(model, device)
        image_text = probe_image_text(self.trainer, model, device)
        torch.save({"input_ids": torch.tensor(PROBE_IDS), "logits": logits, "image_text": image_text},
                   os.path.join(out, "logits.pt"))


callbacks_map["twinkle_reference"] = TwinkleReference
