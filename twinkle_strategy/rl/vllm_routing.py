"""A CPU stand-in for vLLM's ``enable_return_routed_experts``: the routing record of a rollout, taken in vLLM's routers.

On GPU, vLLM returns what its MoE layers routed (``LLM(..., enable_return_routed_experts=True)``; each completion's
``routed_experts``, ``[tokens, layers, top_k]``), and SGLang likewise (``return_routed_experts``): use that array.
vLLM 0.32's CPU build refuses the option (it needs the V2 model runner, which needs Triton's CPU backend), so the
tests take the same record themselves, in the engine process, here:

* :func:`capture_routing` (run on each engine worker through ``LLM.collective_rpc``) wraps ``select_experts`` of
  every fused-MoE layer's router, in model order, so each forward keeps the expert ids the layer dispatched
  (``topk_ids``, the very tensor the experts kernel then receives);
* :func:`generate_with_routing` generates one request at a time (so each forward's tokens are that request's: the
  prompt, then one token per decoding step; prefix caching must be off, or a cached prefix is not routed again)
  and returns, per prompt, the completion, its logprobs and ``routed_experts`` ``[prompt + completion, layers,
  top_k]``, aligned with ``prompt + completion`` (the last token, which no forward fed, is -1, as in
  :meth:`~twinkle_strategy.rl.RoutingRecorder.generated`).

Only for the tests and CPU experiments: one request at a time is slow, and a server should return the official
array. Imports vLLM lazily: the module is importable without it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from twinkle_strategy.errors import ArgumentError
from twinkle_strategy.rl.record import NOT_RECORDED


@dataclasses.dataclass(frozen=True)
class RoutedCompletion:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # the engine's logprob of each completion token
    routed_experts: torch.Tensor  # [prompt + completion, layers, top_k] int, -1 on the last token


def _routers(model) -> list:
    """The routers of the model's fused-MoE layers, in model order (a layer's router is what its runner calls
    ``select_experts`` on)."""
    routers = []
    for module in model.modules():
        for holder in (module, getattr(module, "runner", None)):
            router = getattr(holder, "router", None) if holder is not None else None
            if router is not None and hasattr(router, "select_experts") and router not in routers:
                routers.append(router)
    return routers


def capture_routing(worker) -> int:
    """Wrap the engine model's routers so each forward's expert ids are kept; returns the number of MoE layers."""
    model = worker.model_runner.get_model()
    routers = _routers(model)
    if not routers:
        raise RuntimeError("vllm_routing: no fused-MoE router found in the engine's model")
    captured: list[list[torch.Tensor]] = [[] for _ in routers]
    for index, router in enumerate(routers):
        if getattr(router.select_experts, "_twinkle_capture", False):
            continue
        own = router.select_experts

        @functools.wraps(own)
        def select_experts(*args, _own=own, _calls=captured[index], **kwargs):
            weights, ids = _own(*args, **kwargs)
            _calls.append(ids.detach().to("cpu", torch.long).clone())
            return weights, ids

        select_experts._twinkle_capture = True
        router.select_experts = select_experts
    model.twinkle_captured_routing = captured
    return len(routers)


def take_captured(worker) -> list[list[torch.Tensor]]:
    """Per MoE layer, the expert ids of every forward since the last call (``[tokens, top_k]`` each); clears them."""
    captured = worker.model_runner.get_model().twinkle_captured_routing
    taken = [list(calls) for calls in captured]
    for calls in captured:
        calls.clear()
    return taken


def generate_with_routing(llm, prompts: list[list[int]], *, max_tokens: int) -> list[RoutedCompletion]:
    """Greedy completions of ``prompts`` (token ids) with their logprobs and routing records (see the module)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if llm.llm_engine.vllm_config.cache_config.enable_prefix_caching:
        raise ArgumentError("vllm_routing: start the engine with enable_prefix_caching=False (a cached prefix is not "
                         "routed again, so its tokens would have no record)")
    (layers,) = set(llm.collective_rpc(capture_routing))  # (every worker holds the same layers)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    completions = []
    for prompt in prompts:
        llm.collective_rpc(take_captured)  # (forwards outside this request: none expected, dropped)
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        per_layer = llm.collective_rpc(take_captured)[0]
        completion = list(output.outputs[0].token_ids)
        fed = torch.stack([torch.cat(calls) for calls in per_layer], dim=1)  # [tokens fed, layers, top_k]
        expected = len(prompt) + len(completion) - 1
        if fed.shape[0] != expected:
            raise RuntimeError(f"vllm_routing: the engine routed {fed.shape[0]} tokens for a request of "
                               f"{len(prompt)} prompt and {len(completion)} completion tokens (expected {expected})")
        last = fed.new_full((1, layers, fed.shape[2]), NOT_RECORDED)
        logprobs = [float(step[token].logprob) for step, token in zip(output.outputs[0].logprobs, completion,
                                                                        strict=True)]
        completions.append(RoutedCompletion(prompt_ids=list(prompt), completion_ids=completion, logprobs=logprobs,
                                            routed_experts=torch.cat([fed, last])))
    return completions
