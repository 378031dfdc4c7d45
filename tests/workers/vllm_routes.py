"""Replay closes a real mismatch: rollouts from vLLM (bf16, CPU), the trainer's forward over them without and with R3.

A phase of tests/workers/vllm_sync.py's launch (2 nodes x 2 ranks, ep=2): the engine process starts a bf16 engine from the strategy's step-3 checkpoint and generates greedy
completions one request at a time, with their logprobs and the routing captured in vLLM's own fused-MoE routers
(twinkle_strategy.rl.vllm_routing: vLLM 0.32's CPU build refuses ``enable_return_routed_experts``, so this is the
stand-in for the official array, in the same [tokens, layers, top_k] layout). Every rank loads that checkpoint in
bf16 (FSDP2 mixed precision), takes its share of the rollouts and forwards them (a) routing freely, recording what
its routers chose, (b) replaying the engine's record (R3), recording what was dispatched. Both ranks' figures are
summed: routing disagreement with the engine and the logprob gap, per case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from twinkle_strategy import NativeFSDPStrategy
from twinkle_strategy.rl.mismatch import logprob_mismatch, routing_disagreement
from twinkle_strategy.rl.record import pad_records

# Prompts of different lengths (the record is padded as the ids are).
PROMPTS = [[1, 2, 3, 4 + i, 9 * i % 128, *range(20, 20 + i % 4)] for i in range(16)]
MAX_TOKENS = 16


def rollouts(engine, path: str) -> list[dict]:
    """The engine's bf16 rollouts of PROMPTS (rank 0 asks; every rank gets them)."""
    box = [engine.command("routes", path, "bfloat16", PROMPTS, MAX_TOKENS) if engine is not None else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def batch(prompts: list[list[int]], completions: list[dict]) -> dict:
    """Right-padded ids, their mask and the engine's record, and the completions' positions and engine logprobs."""
    sequences = [p + c["completion_ids"] for p, c in zip(prompts, completions, strict=True)]
    length = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (length - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in sequences])
    record = pad_records([torch.tensor(c["routed_experts"]) for c in completions], length=length)
    longest = max(len(c["completion_ids"]) for c in completions)
    rollout_logps = torch.zeros(len(sequences), longest)
    completion_mask = torch.zeros(len(sequences), longest, dtype=torch.bool)
    for row, c in enumerate(completions):
        rollout_logps[row, :len(c["logprobs"])] = torch.tensor(c["logprobs"])
        completion_mask[row, :len(c["completion_ids"])] = True
    return {"input_ids": ids, "attention_mask": mask, "record": record, "rollout_logps": rollout_logps,
            "completion_mask": completion_mask, "prompt_lengths": [len(p) for p in prompts]}


def completion_logps(logits: torch.Tensor, data: dict) -> torch.Tensor:
    """The trainer's logprob of each completion token, [rows, longest completion] (0 past a completion's end)."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    out = torch.zeros_like(data["rollout_logps"])
    for row, start in enumerate(data["prompt_lengths"]):
        n = int(data["completion_mask"][row].sum())
        tokens = data["input_ids"][row, start:start + n]
        out[row, :n] = logps[row, start - 1:start - 1 + n].gather(-1, tokens[:, None]).squeeze(-1)
    return out


def replay_closes_the_mismatch(engine, path: str) -> dict:
    completions = rollouts(engine, path)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(PROMPTS), world))
    data = batch([PROMPTS[i] for i in mine], [completions[i] for i in mine])
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="bf16", memory_efficient_init=True, timeout_s=600)
    model, _ = strategy.wrap_model(strategy.from_pretrained(path))
    model.eval()
    ids, mask, record = data["input_ids"], data["attention_mask"], data["record"]
    result = {}
    with torch.no_grad():
        with strategy.routing_record() as own:
            free = model(input_ids=ids, attention_mask=mask).logits
        with strategy.routing_replay(record, input_ids=ids), strategy.routing_record() as used:
            replayed = model(input_ids=ids, attention_mask=mask).logits
    for case, logits, recorder in (("free", free, own), ("r3", replayed, used)):
        gap = logprob_mismatch(completion_logps(logits, data), data["rollout_logps"], mask=data["completion_mask"])
        result[case] = {
            "routing_disagreement": routing_disagreement(record, recorder.routed_experts(like=ids), mask=mask),
            "logprob_abs_gap": gap.mean_abs, "kl_k3": gap.kl_k3, "tokens": gap.tokens}
    result["r3"]["router_agreement"] = strategy.take_routing_agreement()  # the router's own choice vs the record
    decisions = ((record != -1).all(-1) & mask.bool()[..., None]).sum()
    dist.all_reduce(decisions)
    result["decisions"] = int(decisions)  # (token, layer) routing decisions compared, over the ranks
    return result
