"""TRL's GRPOTrainer(use_vllm=True, vllm_mode="colocate") under with_strategy: each rank's engine is synced through
strategy.export_weights (integrations/transformers/grpo_vllm.py), never through TRL's bare load_weights.

One launch (1 node x 2 ranks, ep=2, fp32, every rank in the vllm env's python: tests/workers/grpo_colocate.py):
LoRA on attention and experts, 2 GRPO steps with a colocated engine per rank; after each sync (TRL's, before steps
0 and 1, and one after step 2) the engine's logprobs of fixed sequences equal the trainer's own forward.
"""

import subprocess
from pathlib import Path

import pytest
from multinode import launch

from twinkle_strategy.sources.demo import demo_conversations
from twinkle_strategy.sources.tiny import prepare_tiny_model

REPO = Path(__file__).resolve().parents[2]
# TRL starts the engine in vLLM's default dtype for this fp32 checkpoint on CPU, bf16 (asserted below), so the export
# is cast to bf16 and the engine computes in bf16 against the trainer's fp32: bf16 keeps 8 bits of mantissa (a
# relative error of 2**-9 per weight and activation), which over 2 layers and logprobs of 5-10 units leaves about
# 0.05 (measured: 0.037-0.050 on both ranks). A training step moves the engine's logprobs by 1 to 3 units, so an
# engine left a step behind, or given the base weights without the merged adapter, is far outside TOLERANCE.
TOLERANCE = 0.1
MOVED = 0.5  # the least a step must change the engine's logprobs by (measured: 1.2 and 3.0)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    proc = subprocess.run(["bash", "scripts/vllm_env.sh"], cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, f"scripts/vllm_env.sh failed:\n{(proc.stdout + proc.stderr)[-8000:]}"
    return str(Path(proc.stdout.strip().splitlines()[-1]) / "bin" / "python")


@pytest.fixture(scope="module")
def colocated(vllm_python, tmp_path_factory):
    texts = [m["content"] for r in demo_conversations() for m in r["messages"]]
    # vLLM's CPU attention needs head_dim >= 32; an intermediate size of 32 is the CPU experts' padding multiple.
    ckpt = prepare_tiny_model(str(tmp_path_factory.mktemp("colocate-ckpt") / "qwen3_moe"), texts, head_dim=32,
                              hidden_size=64, intermediate_size=32)
    out = tmp_path_factory.mktemp("grpo-colocate")
    result = launch("grpo_colocate.py", ["--model", ckpt, "--out", str(out / "run")], out, nnodes=1,
                    nproc_per_node=2, timeout=900, python=vllm_python,
                    env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert result.ok(), result.describe()
    results = result.rank_results()
    return [results[rank] for rank in sorted(results)]


def test_each_sync_leaves_every_engine_scoring_as_the_trainer(colocated):
    for rank, result in enumerate(colocated):
        assert result["steps"] == 2 and result["engine_dtype"] == "torch.bfloat16", (rank, result["engine_dtype"])
        scored = result["scored"]
        assert [s["step"] for s in scored] == [0, 1, 2], (rank, [s["when"] for s in scored])
        for s in scored:
            assert s["max_diff"] < TOLERANCE, f"rank {rank}, {s['when']}: engine - trainer logprobs {s['max_diff']}"
            assert s["buckets"] > 0
        # Training moved the weights between the syncs, and the engine followed.
        for before, after in zip(scored, scored[1:], strict=False):
            moved = max(abs(x - y) for rx, ry in zip(before["engine"], after["engine"], strict=True)
                        for x, y in zip(rx, ry, strict=True))
            assert moved > MOVED, f"rank {rank}: the engine did not change from {before['when']} to {after['when']}"


def test_trls_own_sync_never_ran(colocated):
    assert [r["trl_gathers"] for r in colocated] == [0, 0], "TRL's per-parameter load_weights sync ran"
    assert [len(r["scored"]) for r in colocated] == [3, 3]
