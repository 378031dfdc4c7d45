"""The node: which ranks share one, and what its source sends them.

Every rank exchanges where it runs (:class:`RankRecord`) and all agree on the
same :class:`NodeTopology`; a node's *source* is its local rank 0. The
node-level primitives move small objects between the source and the other
ranks of its node only (:mod:`twinkle_strategy.distributed.messages` over the
node's process group); :class:`NodeLink` is what every transfer inside a node
needs, together. With no node group (one rank per node) each is the identity.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from twinkle_strategy.distributed import messages
from twinkle_strategy.distributed.runtime import LaunchEnv
from twinkle_strategy.errors import TopologyError


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """One rank's own view of where it runs; all ranks exchange these to agree on the topology."""

    rank: int
    node_rank: int
    local_rank: int
    local_world_size: int
    hostname: str


@dataclasses.dataclass(frozen=True)
class NodeTopology:
    """Which global ranks share a node, agreed on by every rank.

    ``node_ranks[n]`` lists the global ranks of node ``n`` in local-rank order;
    its first entry is the node's *source* for memory-efficient init.
    """

    num_nodes: int
    local_world_size: int
    node_ranks: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def node_index(self) -> int:
        return self.rank // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def source_rank(self) -> int:
        """Global rank of this node's local rank 0."""
        return self.node_ranks[self.node_index][0]

    @property
    def is_source(self) -> bool:
        return self.rank == self.source_rank


def validate_topology(records: Sequence[RankRecord], rank: int) -> NodeTopology:
    """Check that every node holds the same number of contiguous ranks and build the topology.

    Pure function: every rank calls it on the same gathered records, so every
    rank reaches the same verdict and raises the same error (nobody is left
    waiting in a collective).
    """
    records = sorted(records, key=lambda r: r.rank)
    world_size = len(records)
    sizes = sorted({r.local_world_size for r in records})
    if len(sizes) != 1:
        per_node: dict[int, int] = {}
        for r in records:
            per_node[r.node_rank] = r.local_world_size
        listing = ", ".join(f"node {n}: {s}" for n, s in sorted(per_node.items()))
        raise TopologyError(
            f"LOCAL_WORLD_SIZE differs between nodes ({listing}); "
            "launch every node with the same --nproc_per_node"
        )
    local_world_size = sizes[0]
    if world_size % local_world_size != 0:
        raise TopologyError(
            f"world size {world_size} is not divisible by the node size (LOCAL_WORLD_SIZE={local_world_size}); "
            "every node must run the same number of processes"
        )
    nodes: dict[int, list[RankRecord]] = {}
    for r in records:
        nodes.setdefault(r.node_rank, []).append(r)
    for node_rank, members in sorted(nodes.items()):
        if len(members) != local_world_size:
            raise TopologyError(
                f"node {node_rank} has {len(members)} ranks but LOCAL_WORLD_SIZE is {local_world_size}; "
                "launch every node with the same --nproc_per_node"
            )
        ranks = [m.rank for m in members]
        local_ranks = [m.local_rank for m in members]
        first = ranks[0]
        if ranks != list(range(first, first + local_world_size)) or first % local_world_size != 0:
            raise TopologyError(
                f"ranks of node {node_rank} ({members[0].hostname}) are {ranks}, not a contiguous block "
                f"starting at a multiple of {local_world_size}; launch with torchrun, which numbers ranks node by node"
            )
        if local_ranks != list(range(local_world_size)):
            raise TopologyError(
                f"node {node_rank} has local ranks {local_ranks} for global ranks {ranks}; "
                f"expected 0..{local_world_size - 1} in rank order"
            )
    node_ranks = tuple(
        tuple(m.rank for m in members) for _, members in sorted(nodes.items(), key=lambda kv: kv[1][0].rank)
    )
    return NodeTopology(
        num_nodes=len(node_ranks), local_world_size=local_world_size, node_ranks=node_ranks, rank=rank
    )


def discover_topology(env: LaunchEnv) -> NodeTopology:
    """Exchange every rank's launch info and validate it (collective over the default group)."""
    mine = RankRecord(
        rank=env.rank,
        node_rank=env.node_rank,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        hostname=socket.gethostname(),
    )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return validate_topology([mine], env.rank)
    return validate_topology(messages.all_gather_objects(mine), env.rank)


@dataclasses.dataclass(frozen=True)
class NodeLink:
    """What every transfer inside a node needs, together: who is where (the topology, hence the node's
    source), the node's process group, and the device this rank's collectives use."""

    topology: NodeTopology
    group: dist.ProcessGroup | None
    device: torch.device


def broadcast_from_source(obj, source: int, node_group) -> object:
    """The node source's ``obj`` on every rank of the node."""
    if node_group is None:
        return obj
    return messages.broadcast_object(obj, source, node_group)


def gather_to_source(obj, source: int, node_group) -> list | None:
    """Every node rank's ``obj``, in local-rank order, on the source (None elsewhere)."""
    if node_group is None:
        return [obj]
    return messages.gather_objects(obj, source, node_group)


def scatter_from_source(objs: list | None, source: int, node_group) -> object:
    """Local rank i of the node gets ``objs[i]`` (given on the source only)."""
    if node_group is None:
        return objs[0]
    return messages.scatter_objects(objs, source, node_group)


def max_over_node(value: int, node_group) -> int:
    if node_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=messages.collective_device(node_group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=node_group)
    return int(t.item())
