"""The process's place in the run: the process group, the node topology, the parallel sizes and their meshes.

:func:`place_process` is ``NativeFSDPStrategy.setup``: it starts the process group (or joins the one that is
running), agrees with the other ranks on which of them share a node, and builds every mesh and group the
options ask for, with identical arguments on every rank (see :mod:`twinkle_strategy.parallel`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from twinkle_strategy.config import StrategyConfig
from twinkle_strategy.distributed.node import NodeTopology, discover_topology
from twinkle_strategy.distributed.runtime import LaunchEnv, current_device, init_distributed
from twinkle_strategy.parallel import Meshes, ParallelDims, build_meshes, build_node_groups


@dataclasses.dataclass(frozen=True)
class ProcessPlace:
    """What :func:`place_process` set up; the strategy shows each field as its attribute of the same name."""

    device_type: str  # cuda, npu, cpu ...
    env: LaunchEnv  # what the launcher told this process (rank, world size, local rank ...)
    device: torch.device  # this rank's device
    topology: NodeTopology  # the ranks of each node and each node's source
    dims: ParallelDims  # the parallel sizes, validated against the world
    meshes: Meshes  # the device meshes and groups of those sizes
    node_group: dist.ProcessGroup | None  # this node's ranks (memory_efficient_init), None without it


def place_process(config: StrategyConfig) -> ProcessPlace:
    """Initialise the process group, agree on the topology, build the meshes (collective)."""
    device_type, env = init_distributed(config.device_type, config.backend, timeout_s=config.timeout_s)
    device = current_device(device_type)
    topology = discover_topology(env)
    dims = ParallelDims(world_size=env.world_size, ep_size=config.ep_size, ep_fsdp_size=config.ep_fsdp_size,
                        local_world_size=topology.local_world_size, sp_size=config.sequence_parallel_size)
    meshes = build_meshes(dims, device_type)
    node_group = build_node_groups(topology, device, config.timeout_s) if config.memory_efficient_init else None
    return ProcessPlace(device_type=device_type, env=env, device=device, topology=topology, dims=dims, meshes=meshes,
                        node_group=node_group)
