"""Trained weights into a real vLLM engine (vLLM's CPU build, its own virtualenv: scripts/vllm_env.sh).

One launch (2 nodes x 2 ranks, ep=2, fp32) trains a tiny Qwen3-MoE 3 steps and exports it into a vLLM engine
started from the original checkpoint (tests/workers/vllm_sync.py; the engine runs in its own process,
tests/workers/vllm_engine.py, with the vllm env's python, and the receiver, VLLMReceiver, in the engine's
process). The engine's greedy outputs for 8 prompts then equal a fresh engine's started from the checkpoint the
strategy saved at the same step, and differ from the engine's before the sync. Then LoRA (attention and
experts) 3 steps: the merged export into that engine equals a fresh engine from save_merged's checkpoint. Last,
replay closes a real mismatch (tests/workers/vllm_routes.py): a bf16 engine's rollouts, with the routing captured in
vLLM's routers (the CPU stand-in for ``enable_return_routed_experts``), forwarded by the bf16 trainer at ep=2 (this
launch's 2x2 shape) without and with R3.

The env is built on first use (about 10 minutes, once per machine; scripts/_venvs.sh caches it).
"""

import subprocess
from pathlib import Path

import pytest
from multinode import launch

from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
# vLLM's CPU attention needs head_dim >= 32; an intermediate size of 32 is the CPU experts' own padding multiple.
QWEN = dict(head_dim=32, hidden_size=64, intermediate_size=32)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    proc = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, f"scripts/vllm_env.sh failed:\n{(proc.stdout + proc.stderr)[-8000:]}"
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python")


@pytest.fixture(scope="module")
def synced(vllm_python, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("vllm-ckpt") / "qwen3_moe"
    save_tiny_checkpoint("qwen3_moe", str(ckpt), **QWEN)
    out = tmp_path_factory.mktemp("vllm-sync")
    result = launch("vllm_sync.py", ["--ckpt", str(ckpt), "--vllm-python", vllm_python, "--lora", "--routes"], out, nnodes=2,
                    nproc_per_node=2, timeout=900)
    assert result.ok(), result.describe()
    return result.rank_results()[0]


def test_synced_engine_generates_as_a_fresh_engine_from_the_same_step(synced):
    after, fresh, before = synced["after"]["outputs"], synced["fresh"]["outputs"], synced["before"]["outputs"]
    assert len(after) == 8 and all(len(tokens) == 8 for tokens in after)
    assert after == fresh, f"synced engine {after} != fresh engine from the saved step {fresh}"
    assert after != before, "the sync changed nothing: the engine still generates as before training"


def test_every_bucket_reached_the_engine(synced):
    for case in ("after", "lora_after"):
        assert synced[case]["buckets"] == synced[case]["export_buckets"] > 1, case
        assert synced[case]["loaded"] > 0, case


def test_lora_merged_export_generates_as_the_merged_checkpoint(synced):
    after, fresh = synced["lora_after"]["outputs"], synced["lora_fresh"]["outputs"]
    assert after == fresh, f"engine after the merged LoRA export {after} != fresh engine from save_merged {fresh}"
    assert after != synced["fresh"]["outputs"], "the LoRA export changed nothing in the engine"


def test_r3_replays_the_vllm_rollouts_routing_and_shrinks_the_logprob_gap(synced):
    routes = synced["routes"]
    free, r3 = routes["free"], routes["r3"]
    print(f"vLLM bf16 rollouts vs the bf16 trainer over {routes['decisions']} (token, layer) decisions: {free} "
          f"without replay, {r3} with R3")
    assert routes["decisions"] > 0 and free["tokens"] == r3["tokens"] > 0
    assert r3["routing_disagreement"] == 0.0, f"R3 dispatched other experts than the engine's record: {r3}"
    assert free["routing_disagreement"] > 0, f"the free forward routed exactly as vLLM: no mismatch measured {free}"
    assert r3["logprob_abs_gap"] < free["logprob_abs_gap"], f"R3 did not shrink the logprob gap: {free} -> {r3}"
