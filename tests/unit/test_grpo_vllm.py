"""GRPOTrainer(use_vllm=True) under with_strategy, without vLLM: what is refused before TRL connects, and which
runs get the strategy's sync (the colocated sync itself: tests/vllm_engine/test_grpo_colocate.py; the server's
receiver against TRL's VLLMClient: tests/vllm_engine/test_vllm_engine_adapters.py)."""

import dataclasses
import types

import pytest

from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.integrations.transformers.grpo_vllm import install_vllm_sync, refuse_vllm_server


def test_server_mode_is_refused_without_cuda_in_one_line_naming_why():
    import torch
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="/tmp/unused", use_vllm=True, vllm_mode="server", report_to=[], use_cpu=True, bf16=False)
    with pytest.raises(ParallelConfigError) as raised:
        refuse_vllm_server(args)  # use_cpu: no CUDA device for TRL's NCCL communicator
    message = str(raised.value)
    assert "\n" not in message and "vllm_mode='server'" in message and "NCCL" in message and "CUDA" in message
    if torch.cuda.is_available():  # a GPU: only use_cpu is refused
        refuse_vllm_server(dataclasses.replace(args, use_cpu=False))
    refuse_vllm_server(GRPOConfig(output_dir="/tmp/unused", use_vllm=True, vllm_mode="colocate", report_to=[], use_cpu=True, bf16=False))
    refuse_vllm_server(None)  # no args: TRL's defaults (no vLLM)


@pytest.mark.parametrize("use_vllm, mode, replaced", [(True, "colocate", True), (True, "server", True),
                                                      (False, "colocate", False), (False, "server", False)])
def test_vllm_engines_get_the_strategys_sync(use_vllm, mode, replaced):
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    trainer = types.SimpleNamespace(use_vllm=use_vllm, vllm_mode=mode, vllm_generation=generation)
    install_vllm_sync(trainer)
    assert ("sync_weights" in vars(generation)) == replaced
    assert hasattr(trainer, "weight_sync_reports") == replaced
