"""Parallel sizes -> validated device meshes and node groups.

One object, :class:`ParallelDims`, owns the arithmetic. Construct it with the
sizes the user asked for; it raises :class:`ParallelConfigError` with the numbers
and the fix when they do not fit, and builds every mesh and group the strategy
needs, on every rank, with identical arguments (a requirement of
``new_group``: ranks that call it with different lists deadlock).

Mesh layout
-----------
* ``fsdp_mesh``: 1-D over all ranks. Non-expert parameters are sharded on it.
* ``expert_mesh``: 2-D, dims ``("ep_fsdp", "ep")``, rank = ep_fsdp_index * ep + ep_index.
  An EP group is therefore a block of ``ep`` *consecutive* ranks. torchrun numbers
  ranks node by node, so when ``ep`` divides ``LOCAL_WORLD_SIZE`` every EP group -
  and with it every token all-to-all of the MoE layers, the chattiest collective in
  training - stays inside one node. Expert parameters are sharded on the
  ``ep_fsdp`` dim, whose groups stride across nodes; that traffic is one
  all-gather/reduce-scatter per layer, like plain FSDP.
* ``sequence_mesh`` (only with ``sp > 1``): 2-D, dims ``("dp", "sp")``, rank = dp_index * sp + sp_index.
  A sequence-parallel group is a block of ``sp`` *consecutive* ranks, so its attention all-to-alls
  stay inside a node when ``sp`` divides ``LOCAL_WORLD_SIZE``. Its ranks train on the same examples
  (the data-parallel degree is ``world / sp``). SP is carved independently of EP: the MoE layers
  see each rank's own tokens (its chunk), which EP dispatches within its EP group as without SP, so
  ``ep`` and ``sp`` each divide the world size and neither needs the other's room (world 4, sp 4,
  ep 2 is valid: one SP group spanning two EP groups). Parameters stay sharded over all ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from twinkle_strategy.distributed.node import NodeTopology
from twinkle_strategy.errors import ParallelConfigError

logger = logging.getLogger(__name__)

# twinkle-sft checks its recipe before launch and names the exact count there; a script that builds the strategy
# itself, or swift with the plugin, only learns here. The library names torchrun, which every launcher wraps; the
# swift plugin adds swift's NPROC_PER_NODE (integrations/swift/parts/state.py).
_LAUNCH_FIX = "so that nodes x processes per node is a multiple of {size}"


@dataclasses.dataclass
class ParallelDims:
    world_size: int
    ep_size: int = 1
    ep_fsdp_size: int | None = None
    local_world_size: int | None = None
    sp_size: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        w, ep = self.world_size, self.ep_size
        if w < 1:
            raise ParallelConfigError(f"world_size must be >= 1, got {w}")
        self._validate_divides_world("ep_size", ep)
        self._validate_divides_world("sequence_parallel_size", self.sp_size)
        expected_ep_fsdp = w // ep
        if self.ep_fsdp_size is None:
            self.ep_fsdp_size = expected_ep_fsdp
        elif self.ep_fsdp_size != expected_ep_fsdp:
            raise ParallelConfigError(
                f"ep_fsdp_size {self.ep_fsdp_size} * ep_size {ep} must equal the world size {w}; "
                f"use ep_fsdp_size={expected_ep_fsdp} (or leave it unset)"
            )

    def _validate_divides_world(self, name: str, size: int) -> None:
        """``size`` (ep_size, sequence_parallel_size) must divide the world: one line naming it and the fix."""
        w = self.world_size
        if size < 1:
            raise ParallelConfigError(f"{name} must be >= 1, got {size}")
        if w < size:
            raise ParallelConfigError(
                f"{name} {size} needs {size} processes (or a multiple), this job has {w}: launch them, e.g. "
                f"torchrun --nproc_per_node {size} your_script.py ({_LAUNCH_FIX.format(size=size)})"
            )
        if w % size != 0:
            divisors = [d for d in range(1, w + 1) if w % d == 0]
            raise ParallelConfigError(f"world size {w} is not divisible by {name} {size}; choose {name} among {divisors}")

    @property
    def sp_enabled(self) -> bool:
        return self.sp_size > 1

    @property
    def dp_size(self) -> int:
        """Ranks that train on different examples (a sequence-parallel group shares its examples)."""
        return self.world_size // self.sp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    @property
    def ep_enabled(self) -> bool:
        return self.ep_size > 1

    @property
    def ep_within_node(self) -> bool:
        """True when every EP group's all-to-all stays inside one node."""
        return self.local_world_size is None or self.local_world_size % self.ep_size == 0

    def validate_num_experts(self, num_experts: int, where: str = "the model") -> None:
        if num_experts % self.ep_size != 0:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and self.world_size % d == 0]
            raise ParallelConfigError(
                f"{where} has {num_experts} experts, not divisible by ep_size {self.ep_size}; "
                f"choose ep_size among {divisors}"
            )

    def ep_rank(self, rank: int) -> int:
        return rank % self.ep_size

    def ep_fsdp_rank(self, rank: int) -> int:
        return rank // self.ep_size


@dataclasses.dataclass
class Meshes:
    fsdp: DeviceMesh
    expert: DeviceMesh | None  # None when ep_size == 1
    sequence: DeviceMesh | None = None  # ("dp", "sp"); None when sequence_parallel_size == 1

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return None if self.sequence is None else self.sequence.get_group("sp")

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        return None if self.expert is None else self.expert.get_group("ep")

    @property
    def ep_fsdp_mesh(self) -> DeviceMesh | None:
        return None if self.expert is None else self.expert["ep_fsdp"]


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """Create the FSDP and expert meshes (collective: every rank must call this)."""
    fsdp = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("fsdp",))
    expert = None
    if dims.ep_enabled:
        expert = init_device_mesh(
            device_type, (dims.ep_fsdp_size, dims.ep_size), mesh_dim_names=("ep_fsdp", "ep")
        )
        if not dims.ep_within_node:
            logger.warning(
                "ep_size %d spans several nodes (LOCAL_WORLD_SIZE=%s): MoE all-to-all crosses the network",
                dims.ep_size,
                dims.local_world_size,
            )
    sequence = None
    if dims.sp_enabled:
        sequence = init_device_mesh(device_type, (dims.dp_size, dims.sp_size), mesh_dim_names=("dp", "sp"))
    return Meshes(fsdp=fsdp, expert=expert, sequence=sequence)


def build_node_groups(topology: NodeTopology, device: torch.device, timeout_s: float | None = None):
    """One process group per node, created once with the same arguments on every rank, and warmed up.

    ``new_subgroups_by_enumeration`` calls ``new_group`` for every node on every
    rank in the same order, which is what the backends require. NCCL and HCCL
    create communicators lazily, on first use; one small all-reduce here makes
    that happen now, at a known point, rather than in the middle of the
    weight transfer.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    group, _ = dist.new_subgroups_by_enumeration([list(r) for r in topology.node_ranks], **kwargs)
    dist.all_reduce(torch.ones(1, device=device), group=group)
    return group
