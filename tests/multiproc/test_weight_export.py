"""Trained weights to a rollout engine (strategy.export_weights): bucketed, in the checkpoint's own layout, each
tensor from the ranks that own it, never the whole model on one rank.

One launch (2 simulated nodes x 2 ranks, ep=2, fp32) runs every case of tests/workers/weight_export.py; one more
(2 x 4, ep=4) the full-parameter case. The receiver is a separate process with a plain transformers model loaded
from the original (hub-layout, sharded) checkpoint.
"""

import pytest
import torch
from multinode import launch

from twinkle_strategy.rl.export_plan import (
    EngineExperts,
    Item,
    OneReceiver,
    TensorPlan,
    overlaps,
    plan_buckets,
    plan_items,
)
from twinkle_strategy.testing.tiny_models import save_tiny_checkpoint

BUCKET = 1 << 20
LIMIT = 600
QWEN = dict(hidden_size=256, intermediate_size=256, num_layers=4)  # ~30 MB: shards and buckets above the noise


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-ckpts")
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe"), max_shard_size="8MB", **QWEN)
    save_tiny_checkpoint("qwen3_moe", str(root / "qwen3_moe_wider"), max_shard_size="8MB",
                         **{**QWEN, "intermediate_size": 128})
    save_tiny_checkpoint("deepseek_v3", str(root / "deepseek_v3"), max_shard_size="100KB")
    save_tiny_checkpoint("gpt_oss", str(root / "gpt_oss"), max_shard_size="100KB")
    return root


def run(ckpt_root, tmp_path_factory, nproc: int, ep_size: int, cases: str):
    out = tmp_path_factory.mktemp(f"export-{nproc}")
    result = launch("weight_export.py", ["--ckpt-root", str(ckpt_root), "--ep-size", str(ep_size),
                                         "--bucket-bytes", str(BUCKET), "--cases", cases],
                    out, nnodes=2, nproc_per_node=nproc, timeout=LIMIT)
    assert result.ok(), result.describe()
    ranks = result.rank_results()
    return out, ranks[0]["results"], ranks


@pytest.fixture(scope="module")
def at_2x2(ckpt_root, tmp_path_factory):
    return run(ckpt_root, tmp_path_factory, 2, 2, "full,lora,changed,families,engine,faults")


@pytest.fixture(scope="module")
def at_2x4(ckpt_root, tmp_path_factory):
    return run(ckpt_root, tmp_path_factory, 4, 4, "full")


def assert_same(received: dict, expected: dict, *, dtypes: dict | None = None):
    assert sorted(received) == sorted(expected)
    wrong = [k for k in expected if received[k].dtype != (dtypes or {}).get(k, expected[k].dtype)
             or not torch.equal(received[k], expected[k].to(received[k].dtype))]
    assert wrong == [], wrong[:5]


def test_full_export_equals_the_trainer_bit_for_bit(at_2x2):
    out, results, _ = at_2x2
    assert "error" not in results["full"], results["full"]
    assert_same(torch.load(out / "qwen3_moe-full-received.pt"), torch.load(out / "qwen3_moe-full-trainer.pt"))
    assert results["full"]["report"]["buckets"] > 5  # several buckets, experts cut between them
    # Iterated on every rank: the same buckets, the checkpoint's own keys (per-expert hub keys), none elsewhere.
    iterated = results["full"]["iterated"]
    assert iterated["same"] and iterated["keys_as_checkpoint"], iterated
    assert all(data["results"]["full"]["iterated"]["empty_here"] for rank, data in at_2x2[2].items() if rank)


def test_full_export_at_2x4_ep4(at_2x4):
    out, results, _ = at_2x4
    assert_same(torch.load(out / "qwen3_moe-full-received.pt"), torch.load(out / "qwen3_moe-full-trainer.pt"))


@pytest.mark.parametrize("fixture", ["at_2x2", "at_2x4"])
def test_owners_send_what_they_own_once(fixture, request):
    _, results, _ = request.getfixturevalue(fixture)
    report = results["full"]["report"]
    ranks = report["ranks"]
    moved = sum(f["bytes_sent"] + f["bytes_kept"] for f in ranks)
    assert report["bytes_total"] <= moved <= 1.01 * report["bytes_total"], report
    for f in ranks[1:]:
        # A rank that is not the destination sends its own rows, each once: exactly its shard (no expert it
        # does not own, no rows of another rank), and receives nothing.
        assert f["bytes_sent"] == f["shard_bytes"] > 0 and f["bytes_received"] == 0, f
    assert ranks[0]["bytes_kept"] == ranks[0]["shard_bytes"] and ranks[0]["bytes_sent"] == 0, ranks[0]
    assert ranks[0]["bytes_received"] == report["bytes_total"] - ranks[0]["bytes_kept"]


def test_extra_memory_is_at_most_one_bucket_plus_the_shard(at_2x2):
    _, _, ranks = at_2x2
    report = ranks[0]["results"]["full"]["report"]
    assert report["largest_bucket_bytes"] <= BUCKET
    for rank, data in ranks.items():
        figures = report["ranks"][rank]
        bound = report["largest_bucket_bytes"] + figures["shard_bytes"]
        # Every tensor storage the export allocated, alive at once at its peak (counted by a dispatch mode) ...
        assert 0 < data["results"]["full"]["tensor_bytes_peak"] <= bound, (rank, data["results"]["full"], bound)
        # ... and the host memory the process grew by, as the report measures it.
        assert 0 <= figures["peak_extra_bytes"] <= bound, (figures, report)
    # The report's exact count: the destination holds one bucket (plus what the reversed gate_up conversion
    # copies), a sender in the training dtype no copy at all.
    held = [f["bytes_held"] for f in report["ranks"]]
    assert report["largest_bucket_bytes"] <= held[0] <= 2 * report["largest_bucket_bytes"], held
    assert held[1:] == [0] * (len(held) - 1), held


def test_lora_merged_equals_peft_merge_and_unload(at_2x2, ckpt_root):
    from peft import get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    out, results, _ = at_2x2
    assert "error" not in results["lora"], results["lora"]
    adapter = torch.load(out / "lora-merged-trainer.pt")
    base = AutoModelForCausalLM.from_pretrained(str(ckpt_root / "qwen3_moe"), dtype=torch.float32)
    from workers.weight_export import adapter_config

    peft_model = get_peft_model(base, adapter_config(["q_proj", "o_proj"], experts=True))
    peft_model.load_state_dict(adapter, strict=False)
    expected_adapter = get_peft_model_state_dict(peft_model)
    assert_same(torch.load(out / "lora-adapter-received.pt"), expected_adapter)  # the adapter alone, PEFT's keys
    set_peft_model_state_dict(peft_model, expected_adapter)
    merged = peft_model.merge_and_unload().state_dict()
    assert_same(torch.load(out / "lora-merged-received.pt"), merged)


def test_changed_only_sends_the_adapted_attention_layers_and_the_receiver_still_equals(at_2x2, ckpt_root):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    from workers.weight_export import adapter_config

    out, results, _ = at_2x2
    first, second = results["changed"]["first"], results["changed"]["second"]
    loaded = second["receiver"]["loaded"]
    assert loaded and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in loaded), loaded
    assert len(loaded) == 2 * 4  # q and v of each of the 4 layers
    assert second["report"]["bytes_total"] < first["report"]["bytes_total"] / 5
    base = AutoModelForCausalLM.from_pretrained(str(ckpt_root / "qwen3_moe"), dtype=torch.float32)
    peft_model = get_peft_model(base, adapter_config(["q_proj", "v_proj"], experts=False))
    peft_model.load_state_dict(torch.load(out / "changed-trainer.pt"), strict=False)
    assert_same(torch.load(out / "changed-received.pt"), peft_model.merge_and_unload().state_dict())


def test_deepseek_v3_in_bf16_keeps_its_fp32_router(at_2x2, ckpt_root):
    from transformers import AutoModelForCausalLM

    out, results, _ = at_2x2
    assert "error" not in results["deepseek_v3"], results["deepseek_v3"]
    received = torch.load(out / "deepseek_v3-full-received.pt")
    trainer = torch.load(out / "deepseek_v3-full-trainer.pt")
    # The engine's dtypes are what from_pretrained(dtype=bf16) gives: the router (weight and bias) stays fp32.
    engine = {k: v.dtype for k, v in AutoModelForCausalLM.from_pretrained(
        str(ckpt_root / "deepseek_v3"), dtype=torch.bfloat16).state_dict().items()}
    assert {k for k, d in engine.items() if d == torch.float32} >= {"model.layers.1.mlp.gate.weight",
                                                                    "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert_same(received, trainer, dtypes=engine)  # the fp32 router bit for bit, the rest the trainer's in bf16
    # bf16 on the wire (fp32 where the engine keeps it): the bytes of the engine's dtypes, not the trainer's fp32.
    wire = sum(t.numel() * engine[k].itemsize for k, t in trainer.items())
    assert results["deepseek_v3"]["report"]["bytes_total"] == wire


def test_gpt_oss_biases_and_sinks(at_2x2):
    out, results, _ = at_2x2
    received = torch.load(out / "gpt_oss-full-received.pt")
    assert any(k.endswith("sinks") for k in received) and any(k.endswith("gate_up_proj_bias") for k in received)
    assert_same(received, torch.load(out / "gpt_oss-full-trainer.pt"))


def test_engine_ranks_receive_their_experts_and_everything_else(at_2x2):
    out, _, _ = at_2x2
    parts = [torch.load(out / f"engine-rank{j}.pt") for j in (0, 1)]
    experts = [{k for k in part if ".experts." in k} for part in parts]
    assert experts[0] and experts[1] and not experts[0] & experts[1]
    for j, keys in enumerate(experts):
        numbers = {int(k.split(".experts.")[1].split(".")[0]) for k in keys}
        assert numbers == set(range(4 * j, 4 * j + 4)), (j, sorted(numbers))
    others = [{k for k in part if ".experts." not in k} for part in parts]
    assert others[0] == others[1] and others[0]
    assert all(torch.equal(parts[0][k], parts[1][k]) for k in others[0])


def test_a_receiver_that_dies_mid_sync_stops_every_rank_and_leaves_training_as_it_was(at_2x2):
    _, _, ranks = at_2x2
    for data in ranks.values():
        died = data["results"]["faults"]["died"]
        assert died["error"].startswith("WeightSyncError: sending the trained weights"), died
        assert "rank(s) [0]" in died["error"] and "closed the connection" in died["error"], died["error"]
        assert died["state_unchanged"] and died["trained_after"], died
        assert died["seconds_to_error"] < 60, died


def test_a_receiver_of_another_architecture_refuses_before_any_byte(at_2x2):
    _, results, ranks = at_2x2
    refused = results["faults"]["refused"]
    assert refused["receiver"]["buckets"] == 0 and refused["receiver"]["loaded"] == []
    for data in ranks.values():
        error = data["results"]["faults"]["refused"]["error"]
        assert "before any byte moved" in error and "model.layers.0.mlp.experts" in error, error


# ---------------------------------------------------------------------- planning, one process
def test_buckets_hold_at_most_bucket_bytes_and_cut_experts_only():
    specs = [TensorPlan((100, 10), torch.float32, by_experts=False),  # 4000 bytes: alone, whole
             TensorPlan((8, 4, 5), torch.float32, by_experts=True, experts=8),  # 80 bytes per expert
             TensorPlan((3,), torch.float32, by_experts=False)]
    buckets = plan_buckets(plan_items(specs, bucket_bytes=200, receivers=OneReceiver(0)), 200)
    assert buckets[0].items == (Item(0, None, 4000),)
    expert_items = [i for b in buckets for i in b.items if i.tensor == 1]
    assert [i.rows for i in expert_items] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert all(b.nbytes <= 200 for b in buckets[1:])
    split = plan_items(specs, bucket_bytes=1000, receivers=EngineExperts((0, 3)), expert_tensors={1})
    assert [i.rows for i in split[3] if i.tensor == 1] == [(4, 8)] and len(split[0]) == len(split[3]) == 3
    fused = TensorPlan((8, 6, 4), torch.float32, by_experts=False, experts=8, name="model.layers.0.mlp.experts.gate_up")
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.gate_up' \(8, 6, 4\): its "
                                         r"checkpoint stores the experts fused"):
        plan_items([fused], bucket_bytes=1000, receivers=EngineExperts((0, 1)), expert_tensors={0})


def test_overlaps_place_rows_of_a_region_in_a_chunk():
    # A region made of rows [2, 4) then [10, 13) of the full tensor; the chunk is rows [3, 12).
    assert overlaps([(2, 4), (10, 13)], (3, 12)) == [(1, 0, 1), (2, 7, 2)]
    assert overlaps([(0, 5)], (5, 8)) == []


def _checkpoint_buckets(path: str, per_bucket: int):
    """The checkpoint's own tensors, a few per bucket, as an export delivers them."""
    from twinkle_strategy.checkpoint.reading import SafetensorsIndex
    from twinkle_strategy.rl.weight_export import Bucket, TensorMeta

    index = SafetensorsIndex.from_directory(path)
    keys = sorted(index.tensors)
    tensors = [(k, index.read(k)) for k in keys]
    manifest = [TensorMeta(k, tuple(t.shape), t.dtype) for k, t in tensors]
    buckets = [Bucket(i, 0, tensors[a:a + per_bucket], 0) for i, a in enumerate(range(0, len(tensors), per_bucket))]
    index.close()
    return manifest, buckets


def test_a_plain_transformers_model_loads_buckets_as_from_pretrained_loads_the_files(tmp_path):
    """ModelReceiver, one process: per-expert keys spread over buckets are loaded into the fused tensors."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.rl.receivers import ModelReceiver

    source = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "source"), seed=1)
    target = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "target"), seed=2)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    receiver = ModelReceiver(model)
    manifest, buckets = _checkpoint_buckets(source, per_bucket=5)
    receiver.prepare(manifest)
    for bucket in buckets:
        receiver(bucket)
    receiver.finish()
    assert_same(model.state_dict(), AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict())
    assert any(name.endswith("experts.gate_up_proj") for name in receiver.loaded)


def test_a_receiver_refuses_another_architecture_naming_the_first_tensor(tmp_path):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.errors import CheckpointError
    from twinkle_strategy.rl.receivers import ModelReceiver

    source = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "source"))
    wider = save_tiny_checkpoint("qwen3_moe", str(tmp_path / "wider"), intermediate_size=32)
    receiver = ModelReceiver(AutoModelForCausalLM.from_pretrained(wider, dtype=torch.float32))
    with pytest.raises(CheckpointError, match=r"does not match the exported weights: .*'model\.layers\.0\.mlp\.experts"):
        receiver.prepare(_checkpoint_buckets(source, per_bucket=5)[0])


def test_peft_names_map_to_the_transformers_model_names():
    from twinkle_strategy.rl.export_sources import base_name

    assert base_name("base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj") == \
        "model.layers.0.mlp.experts.gate_up_proj"
    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("model.norm.weight") == "model.norm.weight"


def test_buckets_cross_a_connection_byte_for_byte_and_a_refusal_comes_back():
    """ProcessSender and serve_export over a real connection (a thread stands for the other process)."""
    import threading
    from multiprocessing import Pipe

    from twinkle_strategy.errors import CheckpointError
    from twinkle_strategy.rl.receivers import ProcessSender, serve_export
    from twinkle_strategy.rl.weight_export import Bucket, TensorMeta

    tensors = [("a", torch.randn(3, 5, dtype=torch.bfloat16)), ("b", torch.tensor(7, dtype=torch.int64)),
               ("c", torch.empty(0, 4)), ("d", torch.randn(4, 6).t())]  # bf16, a scalar, empty, not contiguous
    got = []

    class Collect:
        def prepare(self, manifest):
            if any(m.name == "refuse" for m in manifest):
                raise ValueError("no place for 'refuse'")

        def __call__(self, bucket):
            got.extend(bucket.tensors)

    near, far = Pipe()
    served = []
    server = threading.Thread(target=lambda: served.append([serve_export(far, Collect()) for _ in range(2)]))
    server.start()
    sender = ProcessSender(near)
    sender.prepare([TensorMeta(k, tuple(v.shape), v.dtype) for k, v in tensors])
    sender(Bucket(0, 0, tensors[:2], 0))
    sender(Bucket(1, 0, tensors[2:], 0))
    sender.finish()
    with pytest.raises(CheckpointError, match="refused the export: ValueError: no place for 'refuse'"):
        sender.prepare([TensorMeta("refuse", (1,), torch.float32)])
    server.join(timeout=30)
    assert served == [[2, 0]]
    assert [k for k, _ in got] == ["a", "b", "c", "d"]
    assert all(v.dtype == w.dtype and torch.equal(v, w) for (_, v), (_, w) in zip(got, tensors, strict=True))
