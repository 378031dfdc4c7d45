"""A vLLM engine in this process (run with the vllm virtualenv's python, scripts/vllm_env.sh), fed by a trainer.

Started by the destination trainer rank (tests/workers/vllm_sync.py) with its listener's address and the original
checkpoint: it starts the engine from that checkpoint at once (while the trainer trains), then serves commands:
("before",) the greedy outputs of the prompts; ("export", model_type) one export received (serve_export) into the
engine through VLLMReceiver, then the outputs again; ("fresh", path) the outputs of a new engine started from
``path``, which then receives the next export; ("routes", path, dtype, prompts, max_tokens) a new engine from ``path``
in ``dtype`` (prefix caching off) generating ``prompts`` one at a time with their logprobs and the routing its MoE
layers captured (twinkle_strategy.rl.vllm_routing: the CPU stand-in for ``enable_return_routed_experts``); ("quit",).
"""

import gc
import os
import sys
import time
from multiprocessing.connection import Client

from twinkle_strategy.rl.receivers import serve_export
from twinkle_strategy.rl.vllm_receiver import VLLMReceiver
from twinkle_strategy.rl.vllm_routing import generate_with_routing

PROMPTS = [[1, 2, 3, 4 + i, 9 * i % 128] for i in range(8)]


def engine(path: str, dtype: str = "float32", **options):
    from vllm import LLM

    return LLM(model=path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=64, seed=0,
               **options)


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main(address: str, authkey: str, path: str) -> None:
    host, port = address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=authkey.encode())
    start = time.perf_counter()
    llm = engine(path)
    started = time.perf_counter() - start
    while True:
        command = connection.recv()
        if command[0] == "before":
            connection.send(("ok", {"outputs": greedy(llm), "engine_start_s": started}))
        elif command[0] == "export":
            receiver = VLLMReceiver(llm, model_type=command[1])
            start = time.perf_counter()
            buckets = serve_export(connection, receiver)
            seconds = time.perf_counter() - start
            connection.send(("ok", {"buckets": buckets, "loaded": len(receiver.loaded), "seconds": seconds,
                                    "outputs": greedy(llm)}))
            del receiver  # (it holds the engine: "fresh" must be able to free it)
        elif command[0] == "fresh":  # the new engine replaces the old one (the next export goes into it)
            # The old engine torn down first (nothing may still hold it): its finalizer destroys vLLM's
            # process-wide parallel groups, which the new engine would be using if the collector ran it later.
            del llm
            gc.collect()
            llm = engine(command[1])
            connection.send(("ok", {"outputs": greedy(llm)}))
        elif command[0] == "routes":  # (the last command before "quit": it replaces the engine)
            path, dtype, prompts, max_tokens = command[1:]
            del llm
            gc.collect()
            llm = engine(path, dtype, enable_prefix_caching=False)
            completions = generate_with_routing(llm, prompts, max_tokens=max_tokens)
            connection.send(("ok", [{"completion_ids": c.completion_ids, "logprobs": c.logprobs,
                                     "routed_experts": c.routed_experts.tolist()} for c in completions]))
        else:
            connection.send(("ok", None))
            return


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default 4 per engine
    main(*sys.argv[1:4])
