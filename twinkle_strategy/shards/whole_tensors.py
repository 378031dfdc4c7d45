"""Tensors a save or a resume must see whole, held by one rank at a time: never gathered on every rank.

Almost all of a checkpoint is written and read back as rows, each rank its own
(:mod:`twinkle_strategy.checkpoint.writing`, ``.reading``). Two kinds of tensor are not:

* tensors that transformers' conversion rule turns into checkpoint tensors only
  whole (``Concatenate(dim=0)`` fusing q/k/v convolutions, Ernie-4.5-VL's
  text and vision experts);
* regions that are not made of rows of the full tensor (PEFT's expert
  ``lora_B``, whose experts lie along dim 1).

Each such tensor has one *owner* rank, picked by its name so that the work
spreads over the ranks. Saving, every rank sends the owner its region and the
owner joins them, converts and writes; resuming, the owner reads the tensor
once and sends every rank its region. Where ``DTensor.full_tensor()`` plus an
EP all-gather would put the whole tensor in every rank's memory, here only the
owner holds it, and only while it writes or serves it.

Which rank keeps which region is exchanged once per call, as a small integer
table (``all_gather`` of a few int64 per tensor); the regions themselves move
by paired point-to-point transfers, which every backend has.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from twinkle_strategy.distributed.messages import collective_device, wait_all
from twinkle_strategy.moe.expert_parallel import ExpertParallelPlan
from twinkle_strategy.shards.plan import NOT_EXPERT, Need, region_of

_WHOLE = -1  # a region's rows in the table when it is the whole (EP-cut) tensor: a parameter FSDP did not shard


def owner_of(name: str, world_size: int) -> int:
    """The rank that holds ``name`` whole: the same on every rank, spread over the ranks by name."""
    return zlib.crc32(name.encode()) % world_size


class WholeTensors:
    """The regions every rank keeps of ``needs`` (the same tensors, in the same order, on every rank).

    Collective to build: one ``all_gather`` of ``(ep_rank, first row, last row)`` per tensor.
    """

    def __init__(self, needs: list[Need], ep_plan: ExpertParallelPlan | None,
                 owner: Callable[[str], int] | None = None, group=None):
        """``owner(name)``: the rank that holds tensor ``name`` whole (default: spread by name, see owner_of).
        ``group``: a group of every rank, in global rank order, to exchange on (default: the default group); an
        asynchronous save's background writers use one of their own, on the host."""
        self.needs, self.ep_plan = needs, ep_plan
        self._owner = owner
        self.group = group
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        device = collective_device(group)
        mine = torch.tensor([[n.ep_rank, *(n.rows if n.rows is not None else (_WHOLE, _WHOLE))] for n in needs],
                            dtype=torch.int64, device=device).reshape(len(needs), 3)
        table = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(table, mine, group=group)
        # keys[i][r]: what rank r keeps of tensor i
        by_rank = [t.cpu().tolist() for t in table]
        self.keys = [[tuple(by_rank[r][i]) for r in range(self.world)] for i in range(len(needs))]

    def owner(self, i: int) -> int:
        name = self.needs[i].name
        return self._owner(name) if self._owner is not None else owner_of(name, self.world)

    def need_at(self, i: int, key: tuple[int, int, int]) -> Need:
        need = self.needs[i]
        rows = None if key[1] == _WHOLE else (key[1], key[2])
        return Need(need.name, key[0], rows, need.shape, need.dtype, need.is_buffer)

    def senders(self, i: int) -> dict[tuple, int]:
        """Each distinct region of tensor ``i`` that has bytes -> the first rank keeping it (replicas send once)."""
        senders: dict[tuple, int] = {}
        for rank, key in enumerate(self.keys[i]):
            if key not in senders and self.need_at(i, key).nbytes:
                senders[key] = rank
        return senders

    def gather(self, i: int, local: torch.Tensor) -> torch.Tensor | None:
        """Tensor ``i`` whole (before EP and FSDP) on its owner, None elsewhere; ``local`` is this rank's region.

        Collective over every rank; the owner receives each distinct region once.
        """
        need, owner = self.needs[i], self.owner(i)
        if need.is_buffer or (need.ep_rank == NOT_EXPERT and need.rows is None):
            return local if self.rank == owner else None  # every rank has all of it
        mine = self.keys[i][self.rank]
        senders = self.senders(i)
        if self.rank != owner:
            if senders.get(mine) == self.rank and mine != self.keys[i][owner]:
                wait_all(dist.batch_isend_irecv([dist.P2POp(dist.isend, local.contiguous(), owner, self.group)]))
            return None
        received = {mine: local}
        ops = []
        for key, sender in senders.items():
            if key not in received:
                received[key] = torch.empty(self.need_at(i, key).region_shape, dtype=local.dtype, device=local.device)
                ops.append(dist.P2POp(dist.irecv, received[key], sender, self.group))
        if ops:
            wait_all(dist.batch_isend_irecv(ops))
        return self._join(i, received, local)

    def _join(self, i: int, regions: dict[tuple, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        need = self.needs[i]
        ep_ranks = [NOT_EXPERT] if need.ep_rank == NOT_EXPERT else list(range(self.ep_plan.ep_size))
        cut = {e: torch.empty(need.shape, dtype=like.dtype, device=like.device) for e in ep_ranks}
        for key, region in regions.items():
            rows = None if key[1] == _WHOLE else (key[1], key[2])
            target = cut[key[0]] if rows is None else cut[key[0]][rows[0]:rows[1]]
            target.copy_(region.reshape(target.shape))
        if need.ep_rank == NOT_EXPERT:
            return cut[NOT_EXPERT]
        return self.ep_plan.axes[need.name].join([cut[e] for e in ep_ranks])

    def scatter(self, i: int, whole: torch.Tensor | None, target: torch.Tensor) -> None:
        """Fill ``target`` (this rank's region of tensor ``i``) from ``whole``, which only the owner has.

        Collective over every rank; the owner sends each rank only its region.
        """
        owner = self.owner(i)
        if self.rank != owner:
            if target.numel():
                received = torch.empty(target.shape, dtype=target.dtype, device=collective_device())
                wait_all(dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, owner)]))
                target.copy_(received)
            return
        ops = []
        for rank, key in enumerate(self.keys[i]):
            need = self.need_at(i, key)
            region = region_of(whole, need, self.ep_plan)
            if rank == self.rank:
                target.copy_(region.reshape(target.shape))
            elif need.nbytes:
                ops.append(dist.P2POp(dist.isend, region.to(collective_device(), target.dtype).contiguous(), rank))
        if ops:
            wait_all(dist.batch_isend_irecv(ops))
