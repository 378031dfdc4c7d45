"""The server-side engine adapters (twinkle_strategy/rl/engines/) against vLLM's and TRL's own trainer-side code.

One process in the vllm env's python (tests/workers/engine_adapters.py; the strategy at world size 1, a tiny
Qwen3-MoE trained one step) checks, each against a reference export of the same model, bucket by bucket:

* ``export_weight_source`` under vLLM's ``NCCLTrainerWeightTransferEngine`` as the sender: the HTTP requests its
  ``HTTPVLLMWeightSyncClient`` makes (to a local recording server) and the tensors it streams through vLLM's own
  metadata check into the packed NCCL producer, twice (the source is re-iterable);
* that source against vLLM's ``ModuleSource`` over a plain transformers model that received the export;
* ``VLLMClientReceiver`` with TRL's real ``VLLMClient``: its requests and the tensors of each batched update,
  alone and through ``sync_server_engine`` (``with_strategy(GRPOTrainer)``'s sync in ``vllm_mode="server"``).

The one part replaced is the NCCL broadcast itself (vLLM's ``packed_nccl_broadcast_producer``, recorded): a NCCL
communicator cannot exist on CPU. A GPU run of the same adapters against ``vllm serve`` is listed in docs/rl.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from preload import forked_python

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    proc = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, f"scripts/vllm_env.sh failed:\n{(proc.stdout + proc.stderr)[-8000:]}"
    python = str(Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python")
    ckpt = tmp_path_factory.mktemp("adapters-ckpt") / "qwen3_moe"
    save_tiny_checkpoint("qwen3_moe", str(ckpt), head_dim=32, hidden_size=64, intermediate_size=32)
    out = tmp_path_factory.mktemp("adapters") / "result.json"
    # the package from this checkout (the vllm env does not install it), as multinode.launch gives it; forked from
    # the vllm env's preload server (tests/preload.py), which imported torch and transformers
    python, env = forked_python(python, {**os.environ, "OMP_NUM_THREADS": "1",
                                         "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    run = subprocess.run([python, str(REPO / "tests/workers/engine_adapters.py"), "--ckpt", str(ckpt), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"engine_adapters.py failed:\n{(run.stdout + run.stderr)[-8000:]}"
    print(run.stderr[-2000:], file=sys.stderr)
    return json.loads(out.read_text())


def test_vllm_trainer_engine_sends_the_export_as_its_weight_source(adapters):
    sender = adapters["vllm_sender"]
    assert sender["is_weight_source"] and sender["metadata_equals_export"], sender
    assert sender["export_buckets"] > 1 and sender["tensors"] > 0
    for i, rnd in enumerate(sender["rounds"]):
        assert rnd["requests"] == ["start_weight_update", "update_weights", "finish_weight_update"], (i, rnd)
        assert rnd["update_info_equals_export"], f"round {i}: /update_weights announced other tensors: {rnd}"
        assert rnd["stream_equals_export"], f"round {i}: the streamed tensors differ from the export: {rnd}"
        assert rnd["report_buckets"] == sender["export_buckets"], rnd


def test_source_equals_vllm_module_source_of_the_trained_weights(adapters):
    module = adapters["module_source"]
    assert module["problems"] == [], module
    # every parameter of the plain model (fused experts included), each moved by the training step
    assert module["checked"] == module["moved"] == 25, module


@pytest.mark.parametrize("case", ["receiver", "grpo_server_sync"])
def test_trl_vllm_client_gets_each_bucket_in_one_weight_update(adapters, case):
    trl = adapters["trl_client"]
    buckets = trl["report_buckets"]
    assert buckets > 1 and trl["receiver_buckets"] == buckets, trl
    got = trl if case == "receiver" else trl["grpo"]
    assert got["requests"] == (["start_weight_update"] + ["update_weights"] * buckets
                               + ["finish_weight_update", "reset_prefix_cache"]), got["requests"]
    assert got["updates_equal_buckets"], "a /update_weights call announced other tensors than its bucket"
    assert got["stream_equals_export"], "TRL's client streamed other tensors than the export's"
