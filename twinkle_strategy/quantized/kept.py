"""A frozen weight of a quantized release kept as stored, dequantized just in time (``quantized_base: keep``).

LoRA never changes the base, so a rank need not hold it in bf16. With ``keep`` the bytes the init
sends for a region of a quantized release (:mod:`twinkle_strategy.quantized.wire`: quantized rows
and the scale rows they need, FSDP- and EP-sharded as the values would be) are what the rank keeps:

* :class:`KeepingSink` takes the region's stream bytes instead of decoding them on arrival;
* :class:`KeptWeight` then stands in for the parameter's FSDP2 shard (the parameter object, its
  name, shape and dtype stay). Before each all-gather of its unit, FSDP2 asks it for its shard
  (``fsdp_pre_all_gather``, FSDP2's extension point for weights stored in another form, as
  torchao's NF4 and float8 weights use it): it decodes the region into a temporary shard in the
  model's dtype, FSDP2 gathers the unit as today and frees the shard. FSDP2 frees the gathered
  weights after the forward and gathers them again for the backward (its usual rhythm), which
  decodes again; the weights are frozen, so there is no gradient to reduce.

The decoded values are the ones the ``dequantize`` path would hold (the same decoder, the same dtype),
so the model computes the same numbers. The stored bytes are never written after the init.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from twinkle_strategy.compat.torch_internals import (
    disabled_torch_function,
    make_wrapper_subclass,
    replace_local_tensor,
)
from twinkle_strategy.errors import FrozenWeightError
from twinkle_strategy.quantized.wire import WireForm

aten = torch.ops.aten
# Ops that hand back the same weight under another name or shape (nn.Parameter, state_dict, FSDP2's padding).
_ALIASES = (aten.detach.default, aten.alias.default)
_VIEWS = (aten.view.default, aten.reshape.default)


@dataclasses.dataclass
class DecodeStats:
    """This process's shards decoded for FSDP2's all-gathers (one per process, as torch's device memory stats):
    how many bytes are alive now and at most since :meth:`reset_peak`."""

    alive_bytes: int = 0
    peak_alive_bytes: int = 0
    decoded_bytes: int = 0  # all decoded since the process started

    def track(self, shard: torch.Tensor) -> None:
        nbytes = shard.numel() * shard.element_size()
        self.alive_bytes += nbytes
        self.decoded_bytes += nbytes
        self.peak_alive_bytes = max(self.peak_alive_bytes, self.alive_bytes)
        weakref.finalize(shard, self._freed, nbytes)  # FSDP2 drops the shard once it is in the all-gather buffer

    def _freed(self, nbytes: int) -> None:
        self.alive_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_alive_bytes = self.alive_bytes


DECODE_STATS = DecodeStats()


@dataclasses.dataclass
class KeptRegion:
    """One rank's region of a model tensor as the release stores it, and how to decode it."""

    name: str  # the model tensor
    form: WireForm  # the pieces and the transformers rule that make its rows
    stored: torch.Tensor  # uint8: the pieces end to end, as the source read them
    rows_shape: tuple[int, ...]  # the region's shape in values
    config: object  # the model config (transformers' rules read it)

    @property
    def stored_bytes(self) -> int:
        return self.stored.numel()

    @property
    def values_bytes(self) -> int:
        return math.prod(self.rows_shape) * self.form.dtype.itemsize

    def dequantize(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The region's values (its rows ``[a, b)`` only, if given) in the model's dtype, decoded chunk by chunk
        into a new tensor (only the chunks those rows lie in), on the device that holds the stored bytes
        (elementwise ops only: nothing is copied to or read back from the host)."""
        # No FP8/FP4 matmul kernel replaces this: torch's _scaled_mm / F.scaled_mm and transformers' finegrained-fp8
        # (Triton, DeepGEMM) multiply FP8 (or FP4) by FP8, so they quantize the bf16 activations (per token, per 128
        # columns), which dequantize-then-bf16-matmul does not: not exact. And FSDP2 gathers the unit's weights, and
        # PEFT adds the expert adapters to them (target_parameters), before any matmul sees them.
        a, b = rows if rows is not None else (0, self.rows_shape[0])
        out = torch.empty((b - a, *self.rows_shape[1:]), dtype=self.form.dtype, device=self.stored.device)
        at = 0
        for chunk in self.form.chunks:
            lo, hi = max(chunk.rows[0], a), min(chunk.rows[1], b)
            if lo < hi:
                values = self.form.decode(chunk, self.stored[at:at + chunk.nbytes], self.config)
                values = values.reshape(chunk.rows[1] - chunk.rows[0], *self.rows_shape[1:])
                out[lo - a:hi - a].copy_(values[lo - chunk.rows[0]:hi - chunk.rows[0]])
            at += chunk.nbytes
        return out


class _Holder:
    """The region a :class:`KeptWeight` and its views share (FSDP2 pads a shard by making a padded tensor and
    copying the shard into its first rows: the copy hands the padded one the region)."""

    def __init__(self, region: KeptRegion | None):
        self.region = region


class KeptWeight(torch.Tensor):
    """A frozen shard held as stored: the shape and dtype of its values, no storage of them.

    Anything that reads it (FSDP2's all-gather, a checksum, ``full_tensor``) gets its values, decoded for
    that use; anything that would write it raises :class:`FrozenWeightError`.
    """

    holder: _Holder

    @staticmethod
    def __new__(cls, holder: _Holder, shape, dtype: torch.dtype, device: torch.device):
        tensor = make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        tensor.holder = holder
        return tensor

    @classmethod
    def of(cls, region: KeptRegion) -> KeptWeight:
        return cls(_Holder(region), region.rows_shape, region.form.dtype, region.stored.device)

    __torch_function__ = disabled_torch_function()

    def __repr__(self, *, tensor_contents=None) -> str:
        name = self.holder.region.name if self.holder.region is not None else "(padding)"
        return f"KeptWeight('{name}', shape={tuple(self.shape)}, dtype={self.dtype}, kept as stored)"

    @property
    def region(self) -> KeptRegion:
        return self.holder.region

    def values(self) -> torch.Tensor:
        """This tensor's values: the region decoded, zero rows past its end (FSDP2's padding), cut to its shape."""
        region = self.holder.region
        decoded = region.dequantize() if region is not None else torch.empty(0, dtype=self.dtype, device=self.device)
        flat = decoded.reshape(-1)
        if flat.numel() < self.numel():
            flat = torch.cat([flat, flat.new_zeros(self.numel() - flat.numel())])
        return flat[:self.numel()].view(self.shape)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of this tensor's values (zero past the region's end: FSDP2's padding), decoding
        only the stored chunks they lie in: what a weight export sends of it, a bucket at a time."""
        region = self.holder.region
        if region is None or tuple(self.shape[1:]) != region.rows_shape[1:]:  # a view of another shape
            return self.values()[start:stop]
        out = torch.zeros((stop - start, *self.shape[1:]), dtype=self.dtype, device=self.device)
        end = min(stop, region.rows_shape[0])
        if start < end:
            out[:end - start].copy_(region.dequantize((start, end)))
        return out

    # FSDP2's all-gather extension: what to gather (a decoded shard, padded as FSDP2 pads) and what it makes.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        padded_rows = math.ceil(outer_size[0] / mesh.size())
        shard = KeptWeight(self.holder, (padded_rows, *self.shape[1:]), self.dtype, self.device).values()
        if mp_policy.param_dtype is not None:
            shard = shard.to(mp_policy.param_dtype)
        DECODE_STATS.track(shard)
        return (shard,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,) = all_gather_outputs
        if out is not None:  # a later all-gather: FSDP2 refilled ``gathered``, which ``out`` views
            return None
        return gathered, (gathered,)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(a for a in args if isinstance(a, KeptWeight))
        if func in _ALIASES:
            return KeptWeight(first.holder, first.shape, first.dtype, first.device)
        if func in _VIEWS:
            shape = torch.empty(first.shape, device="meta").view(args[1]).shape
            return KeptWeight(first.holder, shape, first.dtype, first.device)
        if func is aten.slice.Tensor and (rows := _leading_rows(args)) is not None:  # FSDP2's unpadded shard
            return KeptWeight(first.holder, (rows, *first.shape[1:]), first.dtype, first.device)
        if func is aten.new_zeros.default:  # FSDP2's padded shard: the region comes with the copy below
            return KeptWeight(_Holder(None), tuple(args[1]), first.dtype, first.device)
        if func is aten.copy_.default and isinstance(args[0], KeptWeight) and isinstance(args[1], KeptWeight) \
                and args[0].holder.region is None:
            args[0].holder.region = args[1].holder.region
            return args[0]
        # In place (the first argument) or into an out= tensor: refused when that is a kept weight; reading one
        # into another tensor (``plain.copy_(kept)``) is a read.
        written = args[0] if func.overloadpacket.__name__.endswith("_") else kwargs.get("out")
        if isinstance(written, KeptWeight):
            name = written.holder.region.name if written.holder.region is not None else "a kept weight"
            raise FrozenWeightError(
                f"'{name}' is a frozen weight kept as the release stores it (quantized_base=keep), so it cannot be "
                f"changed ({func}); train adapters over it, or set quantized_base=dequantize to hold it in the "
                "model's dtype")
        unwrap = lambda t: t.values() if isinstance(t, KeptWeight) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})


def _leading_rows(args) -> int | None:
    """The row count of ``aten.slice(tensor, dim, start, end, step)`` if it takes the first rows, else None."""
    tensor, dim, start, end, step = (*args, *(None, 0, None, None, 1)[len(args):])
    if dim != 0 or start not in (0, None) or step != 1:
        return None
    return tensor.shape[0] if end is None else min(end, tensor.shape[0])


class KeepingSink:
    """The receiver's side with ``keep``: takes a region's stream bytes in order and keeps them as stored."""

    def __init__(self, name: str, local: torch.Tensor, form: WireForm, config):
        self.name, self.form, self.config = name, form, config
        self.rows_shape = tuple(local.shape)
        self.nbytes = form.nbytes
        # The shard in the model's dtype (allocated by the model's to_empty) is never filled: freed before the
        # stored bytes are allocated, so the init never holds both for a region.
        local.untyped_storage().resize_(0)
        self.stored = torch.empty(form.nbytes, dtype=torch.uint8, device=local.device)
        self._filled = 0

    def write(self, data: torch.Tensor) -> None:
        self.stored[self._filled:self._filled + data.numel()].copy_(data)
        self._filled += data.numel()

    def region(self) -> KeptRegion:
        if self._filled != self.nbytes:
            raise AssertionError(f"'{self.name}': kept {self._filled} of {self.nbytes} bytes")
        return KeptRegion(self.name, self.form, self.stored, self.rows_shape, self.config)


def keep_regions(model, sinks) -> list[KeptRegion]:
    """Put each :class:`KeepingSink`'s region in place of its parameter's FSDP2 shard (freed by the sink)."""
    regions = []
    for sink in sinks:
        if not isinstance(sink, KeepingSink):
            continue
        region = sink.region()
        replace_local_tensor(model.get_parameter(sink.name), KeptWeight.of(region))
        regions.append(region)
    return regions


def stored_kind(form: WireForm) -> str:
    """The format a region is stored in (fp8_block, fp4_block, mxfp4), for memory reports."""
    return next(piece.codec.kind.value for chunk in form.chunks for piece in chunk.pieces if piece.codec is not None)


def largest_unit_decode_bytes(model: nn.Module) -> int:
    """The most bytes one FSDP2 unit's kept weights decode to for an all-gather (their padded shards, in the
    dtype they are gathered in): what ``keep`` adds, at most, to a step's peak, since the units gather one at a
    time and each drops its decoded shards once they are in the all-gather buffer."""
    largest = 0
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            largest = max(largest, sum(_padded_shard_bytes(param) for param in _unit_parameters(unit)))
    return largest


def _unit_parameters(unit: nn.Module):
    """The parameters ``unit`` gathers itself: its own and its submodules', short of nested units."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield from module.parameters(recurse=False)
        stack += [child for child in module.children() if not isinstance(child, FSDPModule)]


def _padded_shard_bytes(param) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    if not isinstance(local, KeptWeight):
        return 0
    rows = math.ceil(param.shape[0] / param.device_mesh.size())
    return rows * math.prod(param.shape[1:]) * param.dtype.itemsize


def kept_weight_log(report) -> dict:
    """The step log's figures of a ``keep`` run (MiB): what this rank holds of the quantized weights (as stored,
    where kept) and what they are in the model's dtype, and the most decoded shards alive at once since the
    previous log (then reset)."""
    if report is None or not report.frozen_values_bytes or report.quantized_base != "keep":
        return {}
    mib = 2**20
    fields = {"frozen_held(MiB)": round(report.frozen_held_bytes / mib, 3),
              "frozen_as_values(MiB)": round(sum(report.frozen_values_bytes.values()) / mib, 3),
              "frozen_decoded_peak(MiB)": round(DECODE_STATS.peak_alive_bytes / mib, 3)}
    DECODE_STATS.reset_peak()
    return fields
