"""A process outside the trainer's group that receives weight exports into a plain transformers model.

Started by the destination trainer rank (tests/workers/weight_export.py) with the address of its listener.
Commands: ("load", path, dtype) loads the model from the original checkpoint; ("export", partial, die_after)
receives one export (serve_export) into it, exiting abruptly after ``die_after`` buckets if given;
("save", file) writes its state dict; ("collect", file) receives one export as it comes, every bucket's
tensors by name (no model: a quantized release's stored tensors too), and writes them; ("quit",).
"""

import os
import sys
from multiprocessing.connection import Client

import torch
from transformers import AutoModelForCausalLM

from twinkle_strategy.rl.receivers import ModelReceiver, serve_export


class DiesAfter:
    """A receiver that loads ``count`` buckets, then kills its process (the engine crashing mid-sync)."""

    def __init__(self, receiver, count):
        self.receiver, self.count = receiver, count
        self.prepare, self.finish = receiver.prepare, receiver.finish

    def __call__(self, bucket):
        if self.count == 0:
            os._exit(3)
        self.count -= 1
        self.receiver(bucket)


class Collect:
    """Every tensor of an export by its name, as received (refuses a name sent twice)."""

    def __init__(self):
        self.tensors = {}

    def __call__(self, bucket):
        for key, value in bucket.tensors:
            assert key not in self.tensors, f"'{key}' received twice"
            self.tensors[key] = value


def main(address: str, authkey: str) -> None:
    torch.set_num_threads(1)
    host, port = address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=authkey.encode())
    model = None
    while True:
        command = connection.recv()
        if command[0] == "load":
            model = AutoModelForCausalLM.from_pretrained(command[1], dtype=getattr(torch, command[2]))
            connection.send(("ok", None))
        elif command[0] == "export":
            receiver = ModelReceiver(model, partial=command[1])
            buckets = serve_export(connection, receiver if command[2] is None else DiesAfter(receiver, command[2]))
            connection.send(("ok", {"buckets": buckets, "loaded": receiver.loaded}))
        elif command[0] == "collect":
            collected = Collect()
            buckets = serve_export(connection, collected)
            torch.save(collected.tensors, command[1])
            connection.send(("ok", {"buckets": buckets, "keys": sorted(collected.tensors)}))
        elif command[0] == "save":
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, command[1])
            connection.send(("ok", None))
        else:
            connection.send(("ok", None))
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
