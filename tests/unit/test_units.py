"""Pure logic: topology validation, parallel sizes, expert layouts. No processes."""

import pytest
import torch

from twinkle_strategy.distributed.node import RankRecord, validate_topology
from twinkle_strategy.distributed.runtime import LaunchEnv
from twinkle_strategy.errors import ParallelConfigError, TopologyError
from twinkle_strategy.fsdp import mixed_precision_policy
from twinkle_strategy.moe.expert_axis import ExpertAxis
from twinkle_strategy.parallel import ParallelDims


def records(layout):
    """layout: list of (rank, node, local_rank, local_world_size)."""
    return [RankRecord(r, n, lr, lws, f"host{n}") for r, n, lr, lws in layout]


def test_topology_two_nodes():
    topo = validate_topology(records([(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]), rank=3)
    assert topo.node_ranks == ((0, 1), (2, 3))
    assert topo.num_nodes == 2 and topo.source_rank == 2 and not topo.is_source and topo.local_rank == 1


def test_topology_non_contiguous_ranks():
    with pytest.raises(TopologyError, match=r"ranks of node 0 \(host0\) are \[0, 2\], not a contiguous block"):
        validate_topology(records([(0, 0, 0, 2), (1, 1, 0, 2), (2, 0, 1, 2), (3, 1, 1, 2)]), rank=0)


def test_topology_uneven_nodes():
    with pytest.raises(TopologyError, match=r"LOCAL_WORLD_SIZE differs between nodes \(node 0: 2, node 1: 1\)"):
        validate_topology(records([(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 1)]), rank=0)


def test_launch_env_missing_local_world_size():
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE missing"):
        LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})


def test_launch_env_reads_torchrun_variables():
    env = LaunchEnv.from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)


def test_collectively_returns_the_result_or_raises_naming_the_rank():
    from twinkle_strategy.distributed.fail_together import collectively
    from twinkle_strategy.errors import DistributedInitError, RanksFailedError

    assert collectively("adding", lambda: 1 + 1) == 2
    assert collectively("adding", lambda: 1 / 0, here=False) is None  # not run on this rank: nothing to report

    def fail():
        raise OSError("disk full")

    with pytest.raises(DistributedInitError, match=r"^loading m failed on rank\(s\) \[0\]: rank 0: OSError: disk full$") as info:
        collectively("loading m", fail, error_class=DistributedInitError)
    assert isinstance(info.value, RanksFailedError) and isinstance(info.value.__cause__, OSError)


def test_parallel_dims():
    dims = ParallelDims(world_size=16, ep_size=8, local_world_size=8)
    assert dims.ep_fsdp_size == 2 and dims.ep_within_node
    assert [dims.ep_rank(r) for r in (0, 7, 8, 15)] == [0, 7, 0, 7]
    assert [dims.ep_fsdp_rank(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert not ParallelDims(world_size=16, ep_size=16, local_world_size=8).ep_within_node
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not divisible by ep_size 4; choose ep_size among \[1, 2, 3, 6\]"):
        ParallelDims(world_size=6, ep_size=4)
    with pytest.raises(ParallelConfigError, match="use ep_fsdp_size=2"):
        ParallelDims(world_size=8, ep_size=4, ep_fsdp_size=4)
    with pytest.raises(ParallelConfigError, match="has 6 experts, not divisible by ep_size 4"):
        ParallelDims(world_size=8, ep_size=4).validate_num_experts(6)


@pytest.mark.parametrize("axis,shape", [
    (ExpertAxis(0, 8), (8, 6, 4)),            # gate_up_proj [E, 2I, H]
    (ExpertAxis(0, 8, 1, 3), (24, 5)),        # lora_A [E*r, in]
    (ExpertAxis(1, 8, 3, 1), (5, 24)),        # lora_B [out, r*E], expert fastest
    (ExpertAxis(0, 8, zero_experts=4), (12, 6, 4)),   # LongCat-Flash gate_up_proj [E+Z, 2I, H]
    (ExpertAxis(0, 8, 1, 3, 4), (36, 5)),             # its lora_A [(E+Z)*r, in]
    (ExpertAxis(1, 8, 3, 1, 4), (5, 36)),             # its lora_B [out, r*(E+Z)]
])
def test_expert_axis_cut_join_roundtrip(axis, shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    parts = [axis.cut(full, start, 2) for start in range(0, 8, 2)]
    assert all(p.shape == axis.local_shape(shape, 2) for p in parts)
    assert torch.equal(axis.join(parts), full)


def test_zero_expert_slots_are_shared_out():
    """Each EP rank keeps its routed experts followed by its share of the zero-computation slots."""
    axis = ExpertAxis(0, 8, zero_experts=4)
    full = torch.arange(12)
    assert axis.cut(full, 2, 2).tolist() == [2, 3, 9] == axis.slots(2, 2)
    assert axis.cut(full, 4, 4).tolist() == [4, 5, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="do not carry a whole share of the 4 zero-computation experts"):
        axis.cut(full, 0, 1)


def test_refusals_name_what_differs():
    """An experts module whose call, count or layout we do not know is refused, naming it."""
    from torch import nn
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from twinkle_strategy.errors import ModelStructureError
    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.testing.tiny_models import build_tiny_model

    llama4 = build_tiny_model("llama4")
    for layer in llama4.model.layers:  # a routed-call module where the block passes pre-routed tokens
        layer.feed_forward.experts.__class__ = Qwen3MoeExperts
    with pytest.raises(ModelStructureError, match=r"Llama4ForCausalLM \(model_type 'llama4_text'\) is not supported "
                       r"with ep_size > 1 yet: model.layers.0.feed_forward.experts \(Qwen3MoeExperts, called by "
                       r"Llama4TextMoe\) is called with \[1\] argument\(s\) by Llama4TextMoe, but its "
                       r"forward\(hidden_states, top_k_index, top_k_weights\) takes 3"):
        find_moe_blocks(llama4)
    qwen = build_tiny_model("qwen3_moe")
    for layer in qwen.model.layers:
        layer.mlp.experts = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ModelStructureError, match="is a list of per-expert modules, not fused expert tensors"):
        find_moe_blocks(qwen)
    qwen = build_tiny_model("qwen3_moe")
    del qwen.model.layers[0].mlp.experts.num_experts
    with pytest.raises(ModelStructureError, match="has no integer num_experts"):
        find_moe_blocks(qwen)
    qwen = build_tiny_model("qwen3_moe")
    qwen.model.layers[1].mlp.experts.scale = nn.Parameter(torch.ones(32))  # shared by all experts
    with pytest.raises(ModelStructureError, match=r"model.layers.1.mlp.experts .* has parameters that do not hold "
                                                  r"its 8 experts on dim 0 \(scale \(32,\)\)"):
        find_moe_blocks(qwen)


def test_contracts_read_from_the_code():
    from twinkle_strategy.moe.contracts import CallKind
    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.testing.tiny_models import build_tiny_model

    contracts = {f: find_moe_blocks(build_tiny_model(f))[0].contract for f in ("llama4", "nemotron_h", "longcat_flash")}
    assert contracts["llama4"].kind == CallKind.PRE_ROUTED
    assert contracts["nemotron_h"].kind == CallKind.ROUTED and contracts["nemotron_h"].zero_experts == 0
    assert (contracts["longcat_flash"].num_experts, contracts["longcat_flash"].zero_experts) == (8, 4)
    assert contracts["longcat_flash"].min_top_k == 2


@pytest.mark.parametrize("family,targets", [
    ("qwen3_moe", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    ("nemotron_h", ["mixer.experts.up_proj", "mixer.experts.down_proj"]),         # non-gated experts
    ("llama4", ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]),  # [E, H, 2I]
    ("longcat_flash", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),     # + zero-computation slots
])
def test_lora_expert_cut_matches_peft_delta(family, targets):
    """Cutting base + LoRA tensors for experts [k..k+n) gives PEFT's own delta for exactly those experts."""
    from peft import LoraConfig, get_peft_model

    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.moe.expert_parallel import apply_expert_parallel
    from twinkle_strategy.testing.tiny_models import build_tiny_model

    def peft_model():
        torch.manual_seed(0)
        model = build_tiny_model(family)
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False,
                         target_parameters=targets)
        return get_peft_model(model, cfg)

    def deltas(model):
        found = {}
        for block in find_moe_blocks(model):
            wrapper = block.experts
            while hasattr(wrapper, "get_delta_weight"):
                found[(block.name, wrapper.parameter_name)] = wrapper.get_delta_weight("default")
                wrapper = wrapper.base_layer
        return found

    full_deltas = deltas(peft_model())
    assert full_deltas
    for ep_rank in range(4):
        sliced = peft_model()
        plan = apply_expert_parallel(sliced, ParallelDims(world_size=4, ep_size=4), ep_rank, ep_group=None)
        assert any(".lora_B." in name for name in plan.axes)
        for key, local in deltas(sliced).items():
            full = full_deltas[key]
            expected = full[2 * ep_rank:2 * ep_rank + 2]
            if full.shape[0] > 8:  # LongCat-Flash's gate_up_proj: this rank's one zero-computation slot after
                expected = torch.cat([expected, full[8 + ep_rank:9 + ep_rank]])
            torch.testing.assert_close(local, expected, rtol=0, atol=1e-6)


def test_mixed_precision_rejects_unknown():
    assert mixed_precision_policy("bf16").param_dtype == torch.bfloat16
    assert mixed_precision_policy("no").param_dtype is None
    with pytest.raises(ValueError, match="mixed_precision='int4' is not supported"):
        mixed_precision_policy("int4")


def test_capture_holds_references_and_meta_keeps_ties():
    from twinkle_strategy.init.capture import capture_state, move_to_meta
    from twinkle_strategy.testing.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3_moe", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    capture = capture_state(model)
    # No copy: the capture points at the loaded tensors' memory.
    assert all(capture.tensors[n].data_ptr() == ptr for n, ptr in params.items())
    assert "model.rotary_emb.inv_freq" in capture.tensors  # non-persistent buffers too
    move_to_meta(model)
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not capture.tensors["model.embed_tokens.weight"].is_meta


def test_fsdp_rows_match_torch_chunk():
    from twinkle_strategy.shards.plan import fsdp_rows

    for dim0 in range(0, 12):
        for mesh in range(1, 6):
            chunks = torch.arange(dim0).chunk(mesh) if dim0 else ()
            for r in range(mesh):
                start, stop = fsdp_rows(dim0, mesh, r)
                expected = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(start, stop)) == expected, (dim0, mesh, r)


def test_byte_streams_roundtrip_mixed_dtypes_any_bucket():
    from twinkle_strategy.init.streams import StreamReader, StreamWriter

    sources = [torch.randn(5, 3), torch.arange(7, dtype=torch.int64), torch.randn(4, 6).to(torch.bfloat16)[:, ::2]]
    # Each region arrives as chunks of rows (one row at a time here, or all at once).
    regions = [lambda s=s: iter(s.split(1)) for s in sources[:2]] + [lambda: iter([sources[2]])]
    for bucket in (1, 7, 64, 10_000):
        targets = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
        reader = StreamReader(regions, [s.numel() * s.element_size() for s in sources])
        writer = StreamWriter(targets)
        assert reader.total == writer.total
        while True:
            chunk = torch.empty(bucket, dtype=torch.uint8)
            n = reader.read_into(chunk)
            if n == 0:
                break
            writer.write(chunk[:n])
        assert all(torch.equal(t, s) for t, s in zip(targets, sources, strict=False))


def test_check_need_names_the_tensor():
    from twinkle_strategy.dtypes import TensorSpec
    from twinkle_strategy.shards.plan import NOT_EXPERT, Need, check_need

    w, b = TensorSpec((4, 3), torch.float32), TensorSpec((4,), torch.bfloat16)  # what the source holds, before EP
    assert check_need(Need("w", NOT_EXPERT, (0, 2), (4, 3), torch.float32), w, None, 0) is None
    assert "tensor 'x' is not in the model on source rank 2" in check_need(
        Need("x", NOT_EXPERT, None, (1,), torch.float32), None, None, 2)
    assert "tensor 'w' has shape (4, 3) on source rank 0 (after the EP cut) but the model expects (4, 4)" in \
        check_need(Need("w", NOT_EXPERT, (0, 2), (4, 4), torch.float32), w, None, 0)
    assert "tensor 'b' is torch.bfloat16 on source rank 0 but torch.float32 in the receiving rank's model. " in \
        check_need(Need("b", NOT_EXPERT, None, (4,), torch.float32), b, None, 0)
    # Where transformers chose the dtype (an fp32-kept module), the message says so.
    why = "from_pretrained(dtype=torch.bfloat16) keeps it in torch.float32: X._keep_in_fp32_modules_strict has 'b'"
    assert f"but torch.float32 in the receiving rank's model ({why})" in \
        check_need(Need("b", NOT_EXPERT, None, (4,), torch.float32), b, None, 0, dtype_reason=why)


@pytest.mark.parametrize("axis,shape", [
    (ExpertAxis(0, 8), (8, 6, 4)),
    (ExpertAxis(0, 8, 1, 3), (24, 5)),
    (ExpertAxis(0, 8, zero_experts=4), (12, 6, 4)),   # LongCat-Flash: routed experts, then zero slots
    (ExpertAxis(0, 8, 1, 3, 4), (36, 5)),
    (ExpertAxis(0, 8, 2, 3, 4), (72, 5)),             # expert blocks repeated per outer index
])
def test_expert_axis_row_runs_are_the_cut(axis, shape):
    """Any rows of any rank's cut, read as runs of full rows, are exactly those rows of the cut."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for start in range(0, 8, 2):
        cut = axis.cut(full, start, 2)
        for lo in range(cut.shape[0] + 1):
            for hi in range(lo, cut.shape[0] + 1):
                runs = axis.row_runs(start, 2, lo, hi)
                got = torch.cat([full[a:b] for a, b in runs]) if runs else full[:0]
                assert torch.equal(got, cut[lo:hi]), (start, lo, hi, runs)
                assert all(a < b for a, b in runs)
    if axis.zero_experts and axis.outer == 1:  # a whole LongCat cut is two runs: its experts, its zero slots
        assert len(axis.row_runs(2, 2, 0, axis.local_shape(shape, 2)[0])) == 2


def test_shorten_names_the_first_few_and_counts_the_rest():
    from twinkle_strategy.errors import shorten

    assert shorten(["'a'", "'b'"], 3) == "'a', 'b'"
    assert shorten(["'a'", "'b'", "'c'", "'d'", "'e'"], 3) == "'a', 'b', 'c' and 2 more"
    assert shorten(("x", "y", "z"), 1, "; ") == "x; and 2 more"
    assert shorten([], 3) == ""
