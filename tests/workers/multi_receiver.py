"""One source, several receivers: bounded source memory, backend-portable collectives, a read fault.

One node of 4 ranks (the source and 3 receivers), ep=4, small buckets so that every receiver gets
several and not all the same number. For each transport, the gathered model must equal the
checkpoint bit for bit and the source must hold at most 4 buckets beyond its shards while it sends.
Every torch.distributed call of the init is watched: no object collective, and every tensor on the
device the backend moves tensors on. Last, the source's checkpoint file is cut short after its
headers were read: its read thread fails, and every rank must raise the same named error in seconds.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from alloc_tracker import LiveBytes  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.distributed.messages import device_type_for_backend  # noqa: E402
from twinkle_strategy.init import transport  # noqa: E402

OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")
TENSOR_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "scatter", "gather",
                      "reduce_scatter_tensor", "all_to_all_single", "send", "recv", "batch_isend_irecv")


class CollectiveSpy:
    """Wraps torch.distributed's collectives (they still run): records each call's tensor devices."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.devices: set[str] = set()
        self.object_calls: list[str] = []
        self._originals = {}

    def _tensors(self, args, kwargs):
        found = []
        for value in list(args) + list(kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                item = getattr(item, "tensor", item)  # a P2POp carries its tensor
                if isinstance(item, torch.Tensor):
                    found.append(item)
        return found

    def install(self):
        for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
            original = self._originals[name] = getattr(dist, name)

            def spy(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                if _name in OBJECT_COLLECTIVES:
                    self.object_calls.append(_name)
                self.devices |= {t.device.type for t in self._tensors(args, kwargs)}
                return _original(*args, **kwargs)

            setattr(dist, name, spy)

    def uninstall(self):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def reference_state(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


def watch_transfer(tracker: LiveBytes, record: dict):
    """Measure the memory a rank holds beyond its shards while the transfer runs."""
    original = transport.move_streams

    def measured(*args, **kwargs):
        tracker.mark()
        outcome = original(*args, **kwargs)
        record["extra_peak"], record["at_peak"] = tracker.extra_peak, tracker.at_peak[:12]
        return outcome

    transport.move_streams = measured
    return original


def transfer_case(args, kind, spy):
    strategy = NativeFSDPStrategy(ep_size=4, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=args.bucket_bytes / 2**20, init_transport=kind, verify_init=True,
                                  timeout_s=120)
    spy.install()
    record = {}
    tracker = LiveBytes()
    original = watch_transfer(tracker, record)
    try:
        strategy.setup()
        backend_device = device_type_for_backend(str(dist.get_backend()))
        with tracker:
            model, _ = strategy.wrap_model(strategy.from_pretrained(args.ckpt))
    finally:
        transport.move_streams = original
        spy.uninstall()
    got = strategy.full_state_dict(model)
    want = reference_state(args.ckpt)
    mismatches = sorted(k for k in set(got) | set(want)
                        if k not in got or k not in want or got[k].dtype != want[k].dtype
                        or not torch.equal(got[k], want[k]))
    report = strategy.init_report
    return dict(kind=kind, mismatches=mismatches, report=vars(report), extra_peak=record["extra_peak"], at_peak=record["at_peak"],
                bucket_bytes=args.bucket_bytes, backend_device=backend_device,
                model_bytes=sum(t.numel() * t.element_size() for t in want.values()))


def truncated_after_headers(args):
    """The source's file is cut short once from_pretrained has read its headers; wrap_model must fail fast."""
    strategy = NativeFSDPStrategy(ep_size=4, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=args.bucket_bytes / 2**20, timeout_s=120)
    model = strategy.from_pretrained(args.faulty_ckpt)
    if strategy.topology.is_source:
        weights = os.path.join(args.faulty_ckpt, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) * 2 // 3)
    worker_common.write_result({"fault_started": time.time()})
    try:
        strategy.wrap_model(model)
    finally:
        worker_common.write_result({"fault_ended": time.time()})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--faulty-ckpt", required=True)
    p.add_argument("--bucket-bytes", type=int, default=16384)
    args = p.parse_args()
    spy = CollectiveSpy()
    cases = [transfer_case(args, kind, spy) for kind in ("p2p", "scatter")]
    worker_common.write_result({"cases": cases, "spy": dict(calls=spy.calls, devices=sorted(spy.devices),
                                                             object_calls=spy.object_calls)})
    truncated_after_headers(args)  # must raise on every rank


if __name__ == "__main__":
    worker_common.run(main, failure_waits_for_every_rank_s=60)
