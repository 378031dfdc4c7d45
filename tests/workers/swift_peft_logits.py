"""Plain PEFT on one process: logits of base model + saved adapter on the probe's inputs.

    python swift_peft_logits.py BASE_MODEL ADAPTER_DIR PROBE_LOGITS_PT [BASE_MODEL ADAPTER_DIR PROBE_LOGITS_PT ...]

Prints, for each triple in turn, ``PEFT <peft version> <max |logits - probe logits|>`` for the probe's token ids or, when the
probe recorded an image-text batch, ``PEFT-IMAGE-TEXT <peft version> <max difference>`` for it (the
base loaded with its vision-language class). tests/swift_plugin/test_swift.py runs it with the swift virtualenv's
interpreter (the peft/transformers ms-swift trains with) and imports it in .venv.
"""

import sys

import torch


def _peft_model(model_class, base: str, adapter: str):
    from peft import PeftModel

    model = model_class.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def peft_logits(base: str, adapter: str, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter, logits of the base model)."""
    from transformers import AutoModelForCausalLM

    model = _peft_model(AutoModelForCausalLM, base, adapter)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids).logits
    return logits, base_logits


def peft_image_text_logits(base: str, adapter: str, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter, logits of the base model) of the vision-language class on ``inputs``
    (token ids with image tokens, pixel values, image grids: what swift's template made)."""
    from transformers import AutoModelForImageTextToText

    model = _peft_model(AutoModelForImageTextToText, base, adapter)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
        with model.disable_adapter():
            base_logits = model(**inputs, use_cache=False).logits
    return logits, base_logits


if __name__ == "__main__":
    import peft

    torch.set_num_threads(1)
    # BASE ADAPTER PROBE [BASE ADAPTER PROBE ...]: one line for each, in one process (one start-up for all)
    for i in range(1, len(sys.argv), 3):
        base, adapter, probe_path = sys.argv[i:i + 3]
        probe = torch.load(probe_path)
        if probe.get("image_text") is None:
            logits, _ = peft_logits(base, adapter, probe["input_ids"])
            print("PEFT", peft.__version__, float((logits - probe["logits"]).abs().max()))
        else:
            logits, _ = peft_image_text_logits(base, adapter, probe["image_text"]["inputs"])
            print("PEFT-IMAGE-TEXT", peft.__version__, float((logits - probe["image_text"]["logits"]).abs().max()))
