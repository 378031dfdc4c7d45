"""Engine adapters over the export walk: thin receivers of buckets of checkpoint tensors.

* :class:`ModelReceiver`: a plain transformers model (any process) loads the buckets as ``from_pretrained``
  would load the same checkpoint tensors (transformers' own conversion rules, by
  :class:`~twinkle_strategy.checkpoint.layout.CheckpointLayout`); a model tensor made of several checkpoint
  tensors (the per-expert keys of a fused experts tensor) is loaded once all of them arrived. Its ``prepare``
  refuses an export whose tensors its model does not have, by name, before any byte moves.
* :class:`ProcessSender` / :func:`serve_export`: the buckets to a process outside the trainer's group, over a
  ``multiprocessing.connection`` (a socket): names, shapes and dtypes, then each tensor's raw bytes.
* any callable ``receiver(bucket)``: :meth:`WeightExport.send_to` takes it as it is.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch
from torch import nn

from twinkle_strategy.checkpoint.layout import CheckpointLayout
from twinkle_strategy.dtypes import TensorSpec
from twinkle_strategy.errors import CheckpointError, shorten
from twinkle_strategy.rl.weight_export import Bucket, TensorMeta


class _Received:
    """The checkpoint tensors received and not loaded yet, as a checkpoint index :class:`CheckpointLayout` reads."""

    def __init__(self, manifest: list[TensorMeta]):
        self.tensors = {m.name: TensorSpec(tuple(m.shape), m.dtype) for m in manifest}
        self.values: dict[str, torch.Tensor] = {}
        self.bytes_read = 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        value = self.values[key]
        return value if rows is None else value[rows[0]:rows[1]]

    def close(self) -> None:
        self.values.clear()


class ModelReceiver:
    """Loads buckets into ``model`` (a plain transformers model) by its class's conversion rules.

    ``partial=True`` accepts an export of some tensors only (``changed_only``); otherwise every tensor of the
    model must be in it."""

    def __init__(self, model: nn.Module, *, partial: bool = False):
        self.model, self.partial = model, partial
        self.layout: CheckpointLayout | None = None
        self.loaded: list[str] = []

    def prepare(self, manifest: list[TensorMeta]) -> None:
        self.received = _Received(manifest)
        self.layout = CheckpointLayout(self.received, self.model, "the exported weights")
        required = [] if self.partial else _unique_tensor_names(self.model)
        problems = [str(p) for p in self.layout.problems(required)]
        problems += [f"exported tensor '{key}' has no place in {type(self.model).__name__}"
                     for key in self.layout.unexpected_keys()]
        if problems:
            raise CheckpointError(f"the receiving {type(self.model).__name__} does not match the exported weights: "
                                  f"{shorten(problems, 3, '; ')}; start the engine from the trained model's own "
                                  "checkpoint (same architecture and sizes)")
        self._waiting = {}  # checkpoint key -> model tensors it is part of
        for name, recipe in self.layout.recipes.items():
            for key in recipe.checkpoint_keys:
                self._waiting.setdefault(key, []).append(name)
        self.loaded = []

    def __call__(self, bucket: Bucket) -> None:
        if self.layout is None:
            raise RuntimeError("ModelReceiver got a bucket before prepare(manifest)")
        state = self.model.state_dict(keep_vars=True)
        ready = []
        for key, value in bucket.tensors:
            self.received.values[key] = value
            ready += [n for n in self._waiting.get(key, []) if n not in ready]
        with torch.no_grad():
            for name in ready:
                keys = self.layout.recipes[name].checkpoint_keys
                if all(k in self.received.values for k in keys):
                    state[name].copy_(self.layout.read_rows(name))
                    self.loaded.append(name)
        for name in ready:  # drop the pieces of every tensor loaded (a piece serves one tensor, or several)
            for key in self.layout.recipes[name].checkpoint_keys:
                if key in self.received.values and all(n in self.loaded for n in self._waiting[key]):
                    del self.received.values[key]

    def finish(self) -> None:
        left = sorted(self.received.values)
        if left:
            raise CheckpointError(f"the export ended with checkpoint tensors not loaded: {shorten(left, 4)}")


def _unique_tensor_names(model: nn.Module) -> list[str]:
    """The model's parameters (a tied one once) and persistent buffers: what a checkpoint must hold."""
    persistent = set(model.state_dict())
    return [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in persistent]


# ---------------------------------------------------------------------- a process outside the group
class ProcessSender:
    """A receiver (for :meth:`WeightExport.send_to`) that forwards the export to a process outside the trainer's
    group, which runs :func:`serve_export` on the other end of ``connection``."""

    def __init__(self, connection: Connection, *, name: str = "the receiving process"):
        self.connection, self.name = connection, name

    def _call(self, message, payload: tuple[torch.Tensor, ...] = ()) -> object:
        """Send ``message`` (then each payload tensor's bytes); a bucket streams on, anything else waits for the
        reply."""
        try:
            self.connection.send(message)
            for value in payload:
                self.connection.send_bytes(_bytes_of(value))
            if message[0] == "bucket":
                return None
            reply = self.connection.recv()
        except (EOFError, OSError) as exc:
            raise ConnectionError(f"{self.name} closed the connection during '{message[0]}' "
                                  f"({type(exc).__name__}: it exited or died)") from exc
        if reply[0] != "ok":
            raise CheckpointError(f"{self.name} refused the export: {reply[1]}")
        return reply[1]

    def prepare(self, manifest: list[TensorMeta]) -> None:
        self._call(("prepare", [(m.name, m.shape, _dtype_name(m.dtype)) for m in manifest]))

    def __call__(self, bucket: Bucket) -> None:
        header = [(key, (tuple(value.shape), _dtype_name(value.dtype))) for key, value in bucket.tensors]
        self._call(("bucket", header), tuple(value for _, value in bucket.tensors))

    def finish(self) -> None:
        self._call(("finish",))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes_of(value: torch.Tensor) -> memoryview | bytes:
    """A tensor's bytes without a copy where it is contiguous on the CPU (engines on a GPU copy it down once)."""
    if not value.numel():
        return b""
    return memoryview(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def serve_export(connection: Connection, receiver) -> int:
    """Receive one export on ``connection`` (from a :class:`ProcessSender`) and hand it to ``receiver`` (e.g. a
    :class:`ModelReceiver`); returns the buckets received. A receiver's refusal is sent back as the reply."""
    buckets = 0
    while True:
        message = connection.recv()
        kind = message[0]
        if kind == "bucket":
            tensors = []
            for key, (shape, dtype) in message[1]:
                tensors.append((key, _receive_tensor(connection, shape, getattr(torch, dtype))))
            receiver(Bucket(buckets, -1, tensors, sum(t.numel() * t.element_size() for _, t in tensors)))
            buckets += 1
            continue
        try:
            if kind == "prepare":
                getattr(receiver, "prepare", lambda m: None)(
                    [TensorMeta(name, tuple(shape), getattr(torch, dtype)) for name, shape, dtype in message[1]])
            elif kind == "finish":
                getattr(receiver, "finish", lambda: None)()
        except Exception as exc:  # noqa: BLE001 - the sender raises it on every trainer rank
            connection.send(("error", f"{type(exc).__name__}: {exc}"))
            if kind == "prepare":
                return buckets
            raise
        connection.send(("ok", None))
        if kind == "finish":
            return buckets


def _receive_tensor(connection: Connection, shape, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        connection.recv_bytes_into(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
    else:
        connection.recv_bytes()
    return out
