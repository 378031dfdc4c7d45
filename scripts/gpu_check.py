"""Single-GPU check of the CUDA code paths (run on a machine with one GPU).

    python scripts/gpu_check.py

With one process: memory_efficient_init and the plain path on CUDA (NCCL
process group of size 1), gathered weights equal to the checkpoint bit for
bit, fp32 logits equal to a CPU run, and a few bf16 LoRA training steps on
experts and attention whose loss falls. Prints one JSON line per check.
"""

import json
import os
import socket
import tempfile

import torch


def main():
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

    assert torch.cuda.is_available(), "no GPU"
    path = save_tiny_checkpoint("qwen3_moe", tempfile.mkdtemp(), seed=0)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits
    dist.init_process_group("nccl")
    for mem in (True, False):
        strategy = NativeFSDPStrategy(mixed_precision="no", memory_efficient_init=mem)
        model, _ = strategy.wrap_model(strategy.from_pretrained(path))
        state = strategy.full_state_dict(model)
        exact = all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
        with torch.no_grad():
            diff = (model(input_ids=ids.cuda()).logits.cpu() - ref_logits).abs().max().item()
        print(json.dumps({"check": "init", "memory_efficient_init": mem, "device": str(strategy.device),
                          "weights_exact": exact, "max_logit_diff_vs_cpu": diff,
                          "report": vars(strategy.init_report) if strategy.init_report else None}), flush=True)
    from peft import LoraConfig, get_peft_model

    strategy = NativeFSDPStrategy(mixed_precision="bf16", memory_efficient_init=True)
    model = get_peft_model(strategy.from_pretrained(path), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = strategy.wrap_model(model, optimizer)
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
        strategy.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 4))
    print(json.dumps({"check": "bf16 lora steps", "losses": losses, "falls": losses[-1] < losses[0],
                      "max_memory_MiB": torch.cuda.max_memory_allocated() / 2**20}), flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
