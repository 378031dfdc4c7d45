"""Reinforcement learning on MoE models: routing replay (R2/R3), and what a rollout engine and the trainer exchange.

record.py          the routing record's layout (vLLM/SGLang ``routed_experts``: [tokens, layers, top_k]), padded,
                   packed and checked against a batch
routers.py         how each router family weights the experts it is told to use
replay.py          the router wrappers that replay a record or take one, and the routing agreement telemetry
mismatch.py        trainer/rollout mismatch: the logprob gap and k3 KL, the share of routing decisions that differ
vllm_routing.py    CPU stand-in for vLLM's ``enable_return_routed_experts``: the record taken in vLLM's routers
generation.py      ``generate`` on every rank (synced steps, empty ranks), returning what it routed
strategy_methods.py  what the strategy's RL methods do (routing_replay, generate ...), loaded on their first call
export_plan.py     pure: which rank assembles which rows of which tensor, in which bucket
export_sources.py  what an export sends: a full model, a LoRA model merged on the fly, or its adapter alone
weight_export.py   the export walk: owners send their rows, a destination assembles checkpoint tensors per bucket
export_release.py  a merged export in a quantized release's own format, as save_merged(merged_format='release')
export_options.py  strategy.export_weights's options turned into an export (and what changed_only leaves out)
export_report.py   bytes per rank, seconds blocked, peak extra memory, buckets
receivers.py       engine adapters over the walk: a callable, a plain transformers model, a process outside the group
vllm_receiver.py   a vLLM engine in the same process, through vLLM's layerwise reload
engines/           engines elsewhere: vLLM as a server (vLLM's weight transfer), TRL's VLLMClient, SGLang
"""

from twinkle_strategy.rl.record import NOT_RECORDED, ROUTED_EXPERTS, pack_records, pad_records
from twinkle_strategy.rl.replay import RoutingHooks, RoutingRecorder, routing_hooks

__all__ = ["NOT_RECORDED", "ROUTED_EXPERTS", "RoutingHooks", "RoutingRecorder", "pack_records", "pad_records",
           "routing_hooks"]
