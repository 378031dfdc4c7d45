"""Plain PEFT on one process: logits of base model + saved adapter on the probe's token ids.

    python swift_peft_logits.py BASE_MODEL ADAPTER_DIR PROBE_LOGITS_PT

Prints ``PEFT <peft version> <max |logits - probe logits|>``. tests/test_swift.py runs it with
.venv-swift's interpreter (the peft/transformers ms-swift trains with) and imports it in .venv.
"""

import sys

import torch


def peft_logits(base: str, adapter: str, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter, logits of the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids).logits
    return logits, base_logits


if __name__ == "__main__":
    import peft

    torch.set_num_threads(1)
    base, adapter, probe_path = sys.argv[1:4]
    probe = torch.load(probe_path)
    logits, _ = peft_logits(base, adapter, probe["input_ids"])
    print("PEFT", peft.__version__, float((logits - probe["logits"]).abs().max()))
