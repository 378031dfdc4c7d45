"""Engine adapters over :meth:`NativeFSDPStrategy.export_weights`, one module per engine, each importing its
engine only when used (a missing engine names the package to install in one line).

vllm_server.py  vLLM as a server: a ``WeightSource`` over the export, for vLLM's own trainer-side weight-transfer
                engines (``WeightTransferTrainerFactory``, NCCL on a GPU) and its HTTP client
trl_client.py   TRL's ``VLLMClient``: each bucket through its batched ``update_named_params``, one weight update
sglang.py       SGLang's ``Engine.update_weights_from_tensor``, a bucket per call, the cache flushed once
sglang_distributed.py  SGLang's ``update_weights_from_distributed``: a bucket per call, broadcast over the group
                it opens with ``init_weights_update_group`` (sglang_http.py: the same calls to an SGLang server)

In-process receivers (a callable, a plain transformers model, a process over a pipe, a ``vllm.LLM`` in the same
process) are in :mod:`twinkle_strategy.rl.receivers` and :mod:`twinkle_strategy.rl.vllm_receiver`.
"""
