"""Trained weights into a real vLLM engine: tests/vllm_engine/test_vllm_sync.py's one launch.

Every rank trains a tiny Qwen3-MoE 3 steps at ep=2; rank 0, the destination, starts a vLLM engine process
(vllm_engine.py, in the vllm virtualenv) from the original checkpoint first, so the engine starts while the ranks
train. The export goes into that engine (VLLMReceiver through ProcessSender), the strategy saves the same step's
checkpoint, and the engine process answers with the greedy outputs before the sync, after it, and of a fresh
engine started from the saved checkpoint. With --lora: then LoRA (attention and experts) on the original
checkpoint, 3 steps, the merged export into that fresh engine, and a fresh engine from save_merged's checkpoint.
"""

import argparse
import os
import secrets
import subprocess
import sys
from multiprocessing.connection import Listener

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from vllm_routes import replay_closes_the_mismatch  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.rl.receivers import ProcessSender  # noqa: E402

# What the engine process must not inherit: torchrun's rendezvous (vLLM would read LOCAL_RANK and the rest).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE")


class Engine:
    """Rank 0's handle on the engine process."""

    def __init__(self, python: str, path: str):
        authkey = secrets.token_hex(8)
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey.encode())
        host, port = self.listener.address
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC")}
        self.process = subprocess.Popen([python, os.path.join(os.path.dirname(__file__), "vllm_engine.py"),
                                         f"{host}:{port}", authkey, path], env=env)
        self.connection = self.listener.accept()

    def command(self, *message):
        self.connection.send(message)
        reply = self.connection.recv()
        assert reply[0] == "ok", reply
        return reply[1]


def trained(path: str, lora: bool):
    """``path`` wrapped at ep=2 (LoRA on attention and experts added when ``lora``), trained 3 steps."""
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, timeout_s=600)
    model = strategy.from_pretrained(path)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        model = get_peft_model(model, LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = strategy.wrap_model(model, optimizer)
    generator = torch.Generator().manual_seed(100 + strategy.rank)
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return strategy, model


def export(strategy, model, engine) -> dict:
    """The export into the engine process; what it answers (rank 0), with the export's bucket count."""
    if engine is not None:
        engine.connection.send(("export", model.config.model_type))
    report = strategy.export_weights(model, dtype=torch.float32, bucket_bytes=64 << 10).send_to(
        ProcessSender(engine.connection, name="the vLLM engine process") if engine is not None else None)
    return {**engine.connection.recv()[1], "export_buckets": report.buckets} if engine is not None else {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--routes", action="store_true")
    args = parser.parse_args()
    rank = worker_common.rank()
    engine = Engine(args.vllm_python, args.ckpt) if rank == 0 else None

    strategy, model = trained(args.ckpt, lora=False)
    result = {"before": engine.command("before")} if engine is not None else {}
    result["after"] = export(strategy, model, engine)
    saved = os.path.join(os.environ["TWINKLE_TEST_OUT"], "step3")
    strategy.save_pretrained(model, saved)
    if engine is not None:
        result["fresh"] = engine.command("fresh", saved)
    if args.lora:
        del model
        strategy, model = trained(args.ckpt, lora=True)
        result["lora_after"] = export(strategy, model, engine)
        merged = os.path.join(os.environ["TWINKLE_TEST_OUT"], "lora-merged")
        strategy.save_merged(model, merged)  # (consumes the model: after the export)
        if engine is not None:
            result["lora_fresh"] = engine.command("fresh", merged)
    if args.routes:  # (replaces the engine: last)
        result["routes"] = replay_closes_the_mismatch(engine, saved)
    if engine is not None:
        engine.command("quit")
        engine.process.wait(timeout=120)
    return result


if __name__ == "__main__":
    worker_common.run(main)
