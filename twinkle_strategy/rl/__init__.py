"""Reinforcement learning on MoE models: routing records and routing replay (R2/R3).

* :mod:`.record`: the record's layout (vLLM/SGLang ``routed_experts``: [tokens, layers, top_k]) and how it is
  padded, packed and checked against a batch.
* :mod:`.routers`: how each router family weights the experts it is told to use.
* :mod:`.replay`: the router wrappers that replay a record or take one, and the mismatch telemetry.
"""

from twinkle_strategy.rl.record import NOT_RECORDED, ROUTED_EXPERTS, pack_records, pad_records
from twinkle_strategy.rl.replay import RoutingHooks, RoutingRecorder, routing_hooks

__all__ = ["NOT_RECORDED", "ROUTED_EXPERTS", "RoutingHooks", "RoutingRecorder", "pack_records", "pad_records",
           "routing_hooks"]
