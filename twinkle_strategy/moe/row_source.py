"""The rows an experts module reads, as what they are read from: so the backward can read them again.

An experts module's input rows are large: one row per (token, choice), ``top_k`` times the tokens. LoRA on the
experts needs them in the backward (A's gradient is ``x^T @ grad``), and keeping them would cost what LoRA on
the activations exists to save (:mod:`.lora_experts`). They are cheap to read again from something smaller
that is kept anyway: without expert parallelism the layer's tokens and an index (a gather); under expert
parallelism the tokens before the dispatch, an index and the exchange's split sizes (a gather and one
all-to-all, :func:`~twinkle_strategy.moe.dispatch.dispatch`).

A :class:`RowSource` is that pair: ``inputs``, the tensors the rows are read from, and ``read``, the function
that reads them. :func:`~twinkle_strategy.moe.lora_experts.read_with_low_rank` keeps the ``inputs`` for the
backward and calls ``read`` again there, inside ``torch.utils.checkpoint``, so the rows exist only while they
are used. A module that does not recompute calls :meth:`RowSource.read_now` once.

:class:`ReadsRowSource` marks an experts module that takes its rows as a :class:`RowSource`; expert parallelism
(:mod:`.parallel_experts`) hands such a module the source instead of the received rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


def _same(rows: torch.Tensor) -> torch.Tensor:
    return rows


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Rows [num_rows, hidden] = ``read(*inputs)``; their dtype and device are ``inputs[0]``'s."""

    inputs: tuple[torch.Tensor, ...]
    read: Callable[..., torch.Tensor]
    num_rows: int

    @classmethod
    def of(cls, rows: torch.Tensor) -> RowSource:
        """Rows already at hand (kept as they are)."""
        return cls(inputs=(rows,), read=_same, num_rows=rows.shape[0])

    def read_now(self) -> torch.Tensor:
        """The rows, read once (under expert parallelism, a deferred dispatch communicates now)."""
        return self.read(*self.inputs)

    def gather(self, index: torch.Tensor) -> RowSource:
        """The rows ``index`` [n] of these rows, still to be read: ``read(*inputs)[index]``."""
        read = self.read

        def read_gathered(*inputs: torch.Tensor) -> torch.Tensor:
            return read(*inputs[:-1])[inputs[-1]]

        return RowSource(inputs=(*self.inputs, index), read=read_gathered, num_rows=index.shape[0])

    @property
    def hidden_size(self) -> int:
        return self.inputs[0].shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.inputs[0].dtype

    @property
    def device(self) -> torch.device:
        return self.inputs[0].device

    def new_zeros(self) -> torch.Tensor:
        """A zero tensor the rows' shape, dtype and device (without reading them)."""
        return self.inputs[0].new_zeros((self.num_rows, self.hidden_size))


class ReadsRowSource:
    """Mixin: an experts module that takes its rows as a :class:`RowSource` in :meth:`forward_reading`."""

    def forward_reading(self, rows: RowSource, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed call contract's forward, ``rows`` standing for ``hidden_states``."""
        raise NotImplementedError
