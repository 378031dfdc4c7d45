"""What a node's source serves, and models turned into meta.

The source keeps what it can serve without copying it:

* tensors in host memory (a model loaded whole, LoRA adapters, new heads):
  references, no copy (a copy would double host memory);
* placeholders of a streamed checkpoint
  (:class:`twinkle_strategy.init.skeleton.CheckpointTensor`): read from the
  files, rows by rows, when a rank's region is sent.

Then it turns its model into a meta model like every other rank's, so all
ranks run the same EP and FSDP code on meta tensors. The capture is released
when distribution ends.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import torch
from torch import nn

from twinkle_strategy.compat.torch_internals import buffer_slots, parameter_slots
from twinkle_strategy.dtypes import TensorSpec, kept_reasons, loaded_dtype, pretrained_model
from twinkle_strategy.init.skeleton import CheckpointTensor
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.quantized.wire import plan_wire_form, read_chunks
from twinkle_strategy.shards.plan import Need, checkpoint_runs, region_of, runs_within


@dataclasses.dataclass
class Capture:
    tensors: dict[str, torch.Tensor]  # held in host memory, by reference
    placeholders: dict[str, CheckpointTensor]  # read from a checkpoint
    # Why transformers gave a tensor another dtype than the one requested (fp32-kept modules), by name.
    dtype_reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    _whole: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # checkpoint tensors read whole
    _cut_after_reading: set[str] = dataclasses.field(default_factory=set)  # parameters among them
    _uses: dict[str, int] = dataclasses.field(default_factory=dict)  # regions left to serve from a whole tensor
    # The source's streams read in threads of their own (one per receiver, one for its own shards).
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def layouts(self) -> list:
        return list({id(p.checkpoint): p.checkpoint for p in self.placeholders.values()}.values())

    @property
    def bytes_read(self) -> int:
        return sum(layout.bytes_read for layout in self.layouts)

    @property
    def read_seconds(self) -> float:
        return sum(layout.index.read_seconds for layout in self.layouts)

    @property
    def held_whole(self) -> frozenset[str]:
        """Checkpoint tensors read whole and held now, until the last region cut from them is served."""
        return frozenset(self._whole)

    @property
    def whole_tensors(self) -> list[str]:
        """Model tensors a conversion rule forced to read whole instead of by rows."""
        return sorted(set().union(*(layout.materialized_whole for layout in self.layouts)) | self._cut_after_reading)

    def describe(self, name: str) -> TensorSpec | None:
        """Shape and dtype (before EP) of what the source holds for ``name``, or None."""
        tensor = self.tensors.get(name)
        if tensor is None:
            tensor = self.placeholders.get(name)
        return None if tensor is None else TensorSpec.of(tensor)

    def region_chunks(self, need: Need, ep_plan: ExpertParallelPlan | None, chunk_bytes: int) -> Iterator[torch.Tensor]:
        """``need``'s region as consecutive chunks of rows of at most ``chunk_bytes`` (at least one row).

        Never more than one chunk exists at a time on the reading side, so a
        region of any size costs a bucket's worth of memory, not its own size.
        """
        shape = need.region_shape
        if not shape or shape[0] == 0:
            yield self.region(need, ep_plan, None)
        else:
            row_bytes = max(need.nbytes // shape[0], 1)
            step = max(chunk_bytes // row_bytes, 1)
            for lo in range(0, shape[0], step):
                yield self.region(need, ep_plan, (lo, min(lo + step, shape[0])))
        self._served(need.name)

    def expect(self, all_needs: list[list[Need]], ep_plan: ExpertParallelPlan | None) -> None:
        """Count the regions the node's ranks need from each tensor that is read whole (buffers, rules that
        need the whole tensor): it is read once, held while they are served, and released after the last."""
        for needs in all_needs:
            for need in needs:
                if self._read_whole(need, ep_plan):
                    self._uses[need.name] = self._uses.get(need.name, 0) + 1

    def _read_whole(self, need: Need, ep_plan: ExpertParallelPlan | None) -> bool:
        placeholder = self.placeholders.get(need.name)
        if need.name in self.tensors or placeholder is None:
            return False
        runs = None if need.is_buffer else checkpoint_runs(need, ep_plan, placeholder.shape)
        return runs is None or not placeholder.checkpoint.row_readable(placeholder.key)

    def _served(self, name: str) -> None:
        with self._lock:
            if name in self._uses:
                self._uses[name] -= 1
                if not self._uses[name]:
                    del self._uses[name]
                    self._whole.pop(name, None)

    def wire_form(self, need: Need, ep_plan: ExpertParallelPlan | None, chunk_bytes: int):
        """How ``need``'s region travels as the checkpoint stores it (quantized bytes and scales, fewer than its
        values), or None to send its values. See :mod:`twinkle_strategy.quantized.wire`."""
        placeholder = self.placeholders.get(need.name)
        if need.name in self.tensors or placeholder is None or need.is_buffer:
            return None
        runs = checkpoint_runs(need, ep_plan, placeholder.shape)
        return None if runs is None else plan_wire_form(placeholder.checkpoint, placeholder.key, runs,
                                                        chunk_bytes=chunk_bytes)

    def wire_chunks(self, need: Need, form) -> Iterator[torch.Tensor]:
        """``need``'s region as stored, read piece by piece, for :meth:`wire_form`'s ``form``."""
        return read_chunks(self.placeholders[need.name].checkpoint, form)

    def region(self, need: Need, ep_plan: ExpertParallelPlan | None, part: tuple[int, int] | None = None
               ) -> torch.Tensor:
        """Rows ``part`` (all if None) of ``need``'s region: a view of a held tensor, or read from the checkpoint."""
        if need.name in self.tensors:
            region = region_of(self.tensors[need.name], need, ep_plan)
            return region if part is None else region[part[0]:part[1]]
        placeholder = self.placeholders[need.name]
        runs = None if need.is_buffer else checkpoint_runs(need, ep_plan, placeholder.shape)
        if runs is not None and placeholder.checkpoint.row_readable(placeholder.key):
            if not placeholder.dim():
                return placeholder.checkpoint.read_rows(placeholder.key, None)
            lo, hi = part if part else (0, need.region_shape[0])
            pieces = [placeholder.checkpoint.read_rows(placeholder.key, run) for run in runs_within(runs, lo, hi)]
            if len(pieces) == 1:
                return pieces[0]
            return torch.cat(pieces) if pieces else placeholder.checkpoint.read_rows(placeholder.key, (0, 0))
        # A buffer (every rank needs it whole: read once per node, not once per rank), a region that is not made
        # of rows of the checkpoint tensor (experts on another dim) or a rule that needs the whole tensor:
        # read whole, once per node, held until the last region it serves is out (see expect).
        with self._lock:
            if need.name not in self._whole:
                self._whole[need.name] = placeholder.checkpoint.read_rows(placeholder.key)
                if not need.is_buffer:
                    self._cut_after_reading.add(need.name)
            whole = self._whole[need.name]
        region = region_of(whole, need, ep_plan)
        return region if part is None else region[part[0]:part[1]]

    def release(self) -> None:
        self.tensors.clear()
        self._whole.clear()
        for layout in self.layouts:
            layout.close()
        self.placeholders.clear()


def capture_state(model: nn.Module) -> Capture:
    """References to every parameter and buffer (non-persistent ones such as RoPE ``inv_freq`` too).

    Placeholders are kept as what they are, to be read from their checkpoint.
    Meta tensors have no value to serve and are left out; a rank that needs
    one gets an error naming it.
    """
    tensors: dict[str, torch.Tensor] = {}
    placeholders: dict[str, CheckpointTensor] = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if isinstance(tensor, CheckpointTensor) and tensor.checkpoint is not None:
            placeholders[name] = tensor
        elif not tensor.is_meta and not isinstance(tensor, CheckpointTensor):
            tensors[name] = tensor.detach()
    return Capture(tensors, placeholders, dtype_reasons=_dtype_reasons(model))


def _dtype_reasons(model: nn.Module) -> dict[str, str]:
    """Why each fp32-kept tensor has its dtype, by its name in ``model`` (a PEFT model renames them)."""
    pretrained, dtype = pretrained_model(model), loaded_dtype(model)
    if dtype is None:
        return {}
    by_name = kept_reasons(model, dtype)
    reasons = {id(t): by_name.get(n) for n, t in pretrained.state_dict(keep_vars=True).items()}
    return {name: reasons[id(t)] for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if reasons.get(id(t))}


def move_to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor, keeping shared ones shared.

    ``model.to("meta")`` would give each module its own copy of a tied
    parameter (e.g. ``lm_head.weight`` tied to ``embed_tokens.weight``);
    memoising by identity keeps ties and buffer aliases as the model had them.
    """
    converted: dict[int, torch.Tensor] = {}
    for module in model.modules():
        params, buffers = parameter_slots(module), buffer_slots(module)
        for key, param in list(params.items()):
            if param is None:
                continue
            if id(param) not in converted:
                converted[id(param)] = nn.Parameter(_meta_like(param), requires_grad=param.requires_grad)
            params[key] = converted[id(param)]
        for key, buf in list(buffers.items()):
            if buf is None:
                continue
            if id(buf) not in converted:
                converted[id(buf)] = _meta_like(buf)
            buffers[key] = converted[id(buf)]


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    # Not empty_like: a placeholder refuses every operation on itself.
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def buffer_alias_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, buffer name) that share one tensor; ``to_empty`` would split them apart."""
    groups: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, buf in buffer_slots(module).items():
            if buf is not None:
                groups.setdefault(id(buf), []).append((module, key))
    return [g for g in groups.values() if len(g) > 1]


def restore_buffer_aliases(groups: list[list[tuple[nn.Module, str]]]) -> None:
    for group in groups:
        first_module, first_key = group[0]
        shared = buffer_slots(first_module)[first_key]
        for module, key in group[1:]:
            buffer_slots(module)[key] = shared
