"""Weight export to a rollout engine: every case of tests/multiproc/test_weight_export.py in one launch.

Rank 0 is the destination: it starts a receiver process outside the group (export_receiver.py), which loads a
plain transformers model from the original checkpoint and receives the buckets. Each case trains 3 steps, exports,
and saves what the trainer holds (gathered on rank 0) next to what the receiver holds, for the test to compare.
"""

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Listener

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from alloc_tracker import LiveBytes  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.errors import WeightSyncError  # noqa: E402
from twinkle_strategy.rl.export_plan import EngineExperts  # noqa: E402
from twinkle_strategy.rl.receivers import ProcessSender  # noqa: E402

LORA_SEED = 7


class Receiver:
    """Rank 0's handle on the receiver process (None on the other ranks)."""

    def __init__(self):
        self.authkey = secrets.token_hex(8)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey.encode())
        host, port = self.listener.address
        self.process = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "export_receiver.py"),
                                         f"{host}:{port}", self.authkey], env=os.environ.copy())
        self.connection = self.listener.accept()
        self.sender = ProcessSender(self.connection)

    def command(self, *message):
        self.connection.send(message)
        reply = self.connection.recv()
        assert reply[0] == "ok", reply
        return reply[1]


def adapter_config(targets: list[str], experts: bool):
    from peft import LoraConfig

    return LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None)


def trained(path: str, ep_size: int, lora=None):
    """A model of ``path`` wrapped at ep_size (LoRA ``lora`` added) and its optimizer; the strategy."""
    strategy = NativeFSDPStrategy(ep_size=ep_size, mixed_precision="no", memory_efficient_init=True, timeout_s=60)
    model = strategy.from_pretrained(path)
    if lora is not None:
        from peft import get_peft_model

        torch.manual_seed(LORA_SEED)
        model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = strategy.wrap_model(model, optimizer)
    return strategy, model, optimizer


def train(strategy, model, optimizer, steps: int = 3):
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(100 + strategy.rank)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def figures(report) -> dict:
    return dict(buckets=report.buckets, tensors=report.tensors, bytes_total=report.bytes_total,
                largest_bucket_bytes=report.largest_bucket_bytes, seconds=report.seconds,
                ranks=[vars(f) for f in report.ranks], log_line=report.log_line())


def export_to_receiver(strategy, model, receiver, name: str, *, path: str, dtype: str = "float32", load=True,
                       partial=False, die_after=None, track=False, **options) -> dict:
    """Export ``model`` into the receiver process (loaded from ``path`` first); save both sides for the test."""
    if receiver is not None:
        if load:
            receiver.command("load", path, dtype)
        receiver.connection.send(("export", partial, die_after))
    out = {}
    export = strategy.export_weights(model, dtype=getattr(torch, dtype), **options)
    tracker = LiveBytes()
    try:
        if track:  # every tensor storage the export allocates, alive at its peak
            tracker.mark()
            with tracker:
                report = export.send_to(receiver.sender if receiver is not None else None)
            out["tensor_bytes_peak"] = tracker.extra_peak
        else:
            report = export.send_to(receiver.sender if receiver is not None else None)
        out["report"] = figures(report)
    except WeightSyncError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    if receiver is not None and die_after is None:
        out["receiver"] = receiver.connection.recv()[1]
        if "error" not in out:
            receiver.command("save", os.path.join(os.environ["TWINKLE_TEST_OUT"], f"{name}-received.pt"))
    return out


def save_trainer_state(strategy, model, name: str, keys=None):
    state = strategy.full_state_dict(model, rank0_only=True, keys=keys)
    if strategy.rank == 0:
        torch.save(state, os.path.join(os.environ["TWINKLE_TEST_OUT"], f"{name}-trainer.pt"))


def full_case(args, receiver, family: str, *, dtype="float32") -> dict:
    path = os.path.join(args.ckpt_root, family)
    strategy, model, optimizer = trained(path, args.ep_size)
    train(strategy, model, optimizer)
    result = export_to_receiver(strategy, model, receiver, f"{family}-full", path=path, dtype=dtype, track=True,
                                bucket_bytes=args.bucket_bytes)
    save_trainer_state(strategy, model, f"{family}-full")
    if family == "qwen3_moe":
        result["iterated"] = iterated_check(strategy, model, path, args.bucket_bytes)
    return result, (strategy, model, optimizer)


def iterated_check(strategy, model, path: str, bucket_bytes: int) -> dict:
    """Iterating an export on every rank gives what send_to gives, under the checkpoint's own keys."""
    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

    iterated, called = {}, {}
    buckets = 0
    for bucket in strategy.export_weights(model, bucket_bytes=bucket_bytes):
        iterated.update({k: v.clone() for k, v in bucket.tensors})
        buckets += 1
    strategy.export_weights(model, bucket_bytes=bucket_bytes).send_to(
        lambda bucket: called.update({k: v.clone() for k, v in bucket.tensors}))
    if strategy.rank != 0:
        return dict(buckets=buckets, empty_here=not iterated)
    source = SafetensorsIndex.from_directory(path)
    return dict(buckets=buckets, same=sorted(iterated) == sorted(called) and all(
        torch.equal(iterated[k], called[k]) for k in called), keys_as_checkpoint=set(iterated) == set(source.tensors))


def lora_case(args, receiver) -> dict:
    """LoRA on attention and experts, 3 steps: merged into the receiver, and the adapter alone to a callable."""
    path = os.path.join(args.ckpt_root, "qwen3_moe")
    strategy, model, optimizer = trained(path, args.ep_size, adapter_config(["q_proj", "o_proj"], experts=True))
    train(strategy, model, optimizer)
    result = export_to_receiver(strategy, model, receiver, "lora-merged", path=path, bucket_bytes=args.bucket_bytes)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    save_trainer_state(strategy, model, "lora-merged", keys=trainable)
    received = {}
    report = strategy.export_weights(model, lora="adapter", bucket_bytes=args.bucket_bytes).send_to(
        lambda bucket: received.update({k: v.clone() for k, v in bucket.tensors}))
    if strategy.rank == 0:
        torch.save(received, os.path.join(os.environ["TWINKLE_TEST_OUT"], "lora-adapter-received.pt"))
    result["adapter_report"] = figures(report)
    return result


def changed_only_case(args, receiver) -> dict:
    """LoRA on attention only: a first export of everything, 3 steps, then only what changed."""
    path = os.path.join(args.ckpt_root, "qwen3_moe")
    strategy, model, optimizer = trained(path, args.ep_size, adapter_config(["q_proj", "v_proj"], experts=False))
    first = export_to_receiver(strategy, model, receiver, "changed-first", path=path, bucket_bytes=args.bucket_bytes)
    train(strategy, model, optimizer)
    second = export_to_receiver(strategy, model, receiver, "changed", path=path, load=False, partial=True,
                                changed_only=True, bucket_bytes=args.bucket_bytes)
    save_trainer_state(strategy, model, "changed", keys={n for n, p in model.named_parameters() if p.requires_grad})
    return dict(first=first, second=second)


def faults_case(args, receiver, kept) -> dict:
    """A receiver whose model differs refuses before any byte; a receiver dying mid-sync stops every rank."""
    strategy, model, optimizer = kept
    before = strategy.full_state_dict(model)
    other = os.path.join(args.ckpt_root, "qwen3_moe_wider")
    refused = export_to_receiver(strategy, model, receiver, "refused", path=other, bucket_bytes=args.bucket_bytes)
    path = os.path.join(args.ckpt_root, "qwen3_moe")
    start = time.perf_counter()
    died = export_to_receiver(strategy, model, receiver, "died", path=path, die_after=1,
                              bucket_bytes=args.bucket_bytes // 4)
    died["seconds_to_error"] = time.perf_counter() - start
    after = strategy.full_state_dict(model)
    died["state_unchanged"] = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    train(strategy, model, optimizer, steps=1)  # training goes on after a failed sync
    died["trained_after"] = True
    return dict(refused=refused, died=died)


def engine_experts_case(args, kept) -> dict:
    """An expert-parallel engine of 2 ranks fed by trainer ranks 0 and 1: each gets its experts and the rest."""
    strategy, model, _ = kept
    received = {}
    report = strategy.export_weights(model, bucket_bytes=args.bucket_bytes, receivers=EngineExperts((0, 1))).send_to(
        lambda bucket: received.update({k: v.clone() for k, v in bucket.tensors}))
    if strategy.rank in (0, 1):
        torch.save(received, os.path.join(os.environ["TWINKLE_TEST_OUT"], f"engine-rank{strategy.rank}.pt"))
    return dict(report=figures(report))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    p.add_argument("--cases", default="full,lora,changed,families,faults,engine")
    args = p.parse_args()
    cases = args.cases.split(",")
    NativeFSDPStrategy(ep_size=args.ep_size).setup()
    receiver = Receiver() if dist.get_rank() == 0 else None
    results = {}
    if "full" in cases:
        results["full"], kept = full_case(args, receiver, "qwen3_moe")
    if "lora" in cases:
        results["lora"] = lora_case(args, receiver)
    if "changed" in cases:
        results["changed"] = changed_only_case(args, receiver)
    if "families" in cases:
        results["deepseek_v3"], _ = full_case(args, receiver, "deepseek_v3", dtype="bfloat16")
        results["gpt_oss"], _ = full_case(args, receiver, "gpt_oss")
    if "engine" in cases:
        results["engine"] = engine_experts_case(args, kept)
    if "faults" in cases:
        results["faults"] = faults_case(args, receiver, kept)
    if receiver is not None and receiver.process.poll() is None:
        receiver.command("quit")
    worker_common.write_result({"results": json.loads(json.dumps(results, default=str))})


if __name__ == "__main__":
    worker_common.run(main)
