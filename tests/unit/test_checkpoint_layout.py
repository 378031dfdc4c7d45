"""Reading model tensors region by region from hub-layout checkpoints, in one process (no process groups).

The oracle is transformers' own ``from_pretrained`` of the same checkpoint.
"""

import json
import shutil

import pytest
import torch
from conftest import LAYOUT_CHECKPOINTS

from twinkle_strategy.checkpoint.layout import RowMode
from twinkle_strategy.checkpoint.reading import SafetensorsIndex
from twinkle_strategy.errors import CheckpointError
from twinkle_strategy.init.skeleton import CheckpointTensor, WeightsNotLoadedError
from twinkle_strategy.loading import load_config, meta_skeleton, model_class_for, open_streaming_model
from twinkle_strategy.testing.families import FAMILIES


def reference_state(path):
    config = load_config(str(path))
    return model_class_for(config).from_pretrained(str(path), dtype=torch.float32).state_dict()


def open_layout(path):
    model = open_streaming_model(str(path), load_config(str(path)), torch.float32)
    placeholders = {t.key: t for t in list(model.parameters()) + list(model.buffers())
                    if isinstance(t, CheckpointTensor)}
    return model, next(iter(placeholders.values())).checkpoint, placeholders


@pytest.mark.parametrize("name", list(FAMILIES) + list(LAYOUT_CHECKPOINTS))
def test_every_tensor_and_any_rows_equal_from_pretrained(tiny_checkpoints, name):
    state = reference_state(tiny_checkpoints / name)
    model, layout, placeholders = open_layout(tiny_checkpoints / name)
    assert set(placeholders) <= set(state) and placeholders
    # Fused expert tensors stored per expert in the hub layout are read expert by expert; nothing is read whole.
    per_expert_keys = any(".experts.0." in k for k in layout.index.tensors)
    assert per_expert_keys == any(layout.recipes[k].mode == RowMode.PER_EXPERT for k in placeholders
                                  if "experts.gate_up_proj" in k)
    assert all(recipe.mode != RowMode.WHOLE for recipe in layout.recipes.values())
    for key in placeholders:
        want = state[key]
        assert torch.equal(layout.read_rows(key), want), key
        if want.dim() and want.shape[0] > 2:
            before = layout.bytes_read
            rows = layout.read_rows(key, (1, want.shape[0] - 1))
            assert torch.equal(rows, want[1:-1]), key
            # Exactly those rows were read (the checkpoint stores fp32, like the model).
            assert layout.bytes_read - before == rows.numel() * rows.element_size(), key
    assert layout.materialized_whole == set()


def test_qwen3_vl_moe_hub_layout_is_transposed_on_read(tiny_checkpoints, tmp_path):
    """Released Qwen3-VL-MoE checkpoints store fused experts as [E, H, 2I] / [E, I, H]; transformers' rule
    (Transpose(1, 2) where the shapes differ) is applied to the rows read, not to whole tensors."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "qwen3_vl_moe_hub"
    shutil.copytree(tiny_checkpoints / "qwen3_vl_moe", path)
    weights = load_file(str(path / "model.safetensors"))
    for key in [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weights[key] = weights[key].transpose(1, 2).contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    state = reference_state(tiny_checkpoints / "qwen3_vl_moe")
    _, layout, placeholders = open_layout(path)
    experts = [k for k in placeholders if k.endswith("experts.gate_up_proj")]
    assert experts and all(layout.recipes[k].mode != RowMode.WHOLE for k in experts)
    for key in placeholders:
        assert torch.equal(layout.read_rows(key), state[key]), key
        if key in experts:
            assert torch.equal(layout.read_rows(key, (3, 6)), state[key][3:6]), key
    assert layout.materialized_whole == set()


def test_rules_that_cannot_be_read_by_rows_are_read_whole_and_reported(tiny_checkpoints):
    state = reference_state(tiny_checkpoints / "mixtral")
    _, layout, placeholders = open_layout(tiny_checkpoints / "mixtral")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    layout.recipes[key].mode = RowMode.WHOLE  # as for e.g. a Concatenate(dim=0) rule
    assert torch.equal(layout.read_rows(key, (2, 5)), state[key][2:5])
    assert layout.materialized_whole == {key}


def test_placeholders_refuse_computation_by_name(tiny_checkpoints):
    model, _, placeholders = open_layout(tiny_checkpoints / "qwen3_moe")
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, CheckpointTensor) and weight.device.type == "cpu"
    for use in (lambda: weight * 2, lambda: weight.to(torch.bfloat16), lambda: weight.sum()):
        with pytest.raises(WeightsNotLoadedError, match="'model.layers.0.self_attn.q_proj.weight' has no values"):
            use()
    repr(model)  # printing a model does not touch weights
    receiver = meta_skeleton(load_config(str(tiny_checkpoints / "qwen3_moe")), torch.float32)
    assert receiver.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    # Non-persistent buffers (RoPE) are computed on the source as from_pretrained computes them.
    state = dict(model_class_for(model.config).from_pretrained(str(tiny_checkpoints / "qwen3_moe")).named_buffers())
    for name, buf in model.named_buffers():
        assert torch.equal(buf, state[name]), name


def test_fresh_lora_on_a_source_skeleton_equals_a_single_process(tiny_checkpoints):
    from peft import LoraConfig, get_peft_model

    path = tiny_checkpoints / "qwen3_moe"
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    torch.manual_seed(3)
    reference = get_peft_model(model_class_for(load_config(str(path))).from_pretrained(str(path)), config)
    model, _, _ = open_layout(path)
    torch.manual_seed(3)
    model = get_peft_model(model, config)
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and all(type(p) is not CheckpointTensor and p.device.type == "cpu" for p in adapters.values())
    want = dict(reference.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in adapters.items())


def test_truncated_file_names_the_first_tensor_cut(tiny_checkpoints, tmp_path):
    good = tiny_checkpoints / "mixtral_sharded"
    path = tmp_path / "truncated"
    shutil.copytree(good, path)
    index = json.loads((good / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.0.block_sparse_moe.experts.2.w3.weight"
    stored = SafetensorsIndex.from_directory(str(good)).tensors[key]
    (path / index[key]).write_bytes((path / index[key]).read_bytes()[:stored.begin + 3])
    with pytest.raises(CheckpointError, match=rf"{index[key]} is truncated: .* tensor\(s\) '{key}'"):
        SafetensorsIndex.from_directory(str(path))
    (path / index[key]).unlink()
    with pytest.raises(CheckpointError, match=f"lists '{index[key]}', which does not exist"):
        SafetensorsIndex.from_directory(str(path))


def test_unexpected_checkpoint_tensors_are_reported(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "extra"
    shutil.copytree(tiny_checkpoints / "qwen3_moe", path)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.mlp.surprise.weight"] = torch.zeros(2, 2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.surprise.weight' belong to no tensor of the model"):
        open_streaming_model(str(path), load_config(str(path)), torch.float32)


def test_a_tensor_read_whole_is_read_once_per_node_and_released_after_its_last_region(tiny_checkpoints):
    """A buffer every rank needs whole (DeepSeek's correction bias): the source reads it once for its node's
    three ranks, holds it while their regions are served, and drops it after the last one."""
    from twinkle_strategy.init.capture import capture_state
    from twinkle_strategy.shards.plan import NOT_EXPERT, Need

    path = tiny_checkpoints / "deepseek_v3"
    model = open_streaming_model(str(path), load_config(str(path)), torch.float32)
    capture = capture_state(model)
    name, buffer = next((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    need = Need(name, NOT_EXPERT, None, tuple(buffer.shape), buffer.dtype, is_buffer=True)
    capture.expect([[need], [need], [need]], None)
    want = reference_state(path)[name]
    for served in range(3):
        assert (name in capture.held_whole) == (served > 0)  # held from the first region to the last
        (chunk,) = capture.region_chunks(need, None, 2**20)
        assert torch.equal(chunk, want)
    assert name not in capture.held_whole
    assert capture.bytes_read == want.numel() * want.element_size()


def test_the_three_checkpoint_indexes_are_checkpoint_indexes(tiny_checkpoints):
    from twinkle_strategy.checkpoint.layout import CheckpointIndex, DeclaredTensors
    from twinkle_strategy.dtypes import TensorSpec
    from twinkle_strategy.quantized.formats import QuantFormat, QuantizedIndex

    stored = SafetensorsIndex.from_directory(str(tiny_checkpoints / "qwen3_moe"))
    declared = DeclaredTensors({"w": TensorSpec((2, 3), torch.float32)})
    for index in (stored, QuantizedIndex(stored, QuantFormat("mxfp4", None)), declared):
        assert isinstance(index, CheckpointIndex), type(index).__name__
        key = next(iter(index.tensors))
        assert key in index and isinstance(index.tensors[key].dtype, torch.dtype)
    with pytest.raises(CheckpointError, match="'w' is declared for a save, not written yet"):
        declared.read("w")
    stored.close()
