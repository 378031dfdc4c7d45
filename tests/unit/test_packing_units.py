"""Packing's packs, collator and refusals, in this process (the launches are tests/multiproc/test_packing.py's;
its docstring explains the tolerances)."""

import math

import pytest
import torch

from twinkle_strategy.errors import PackingError
from twinkle_strategy.testing.tiny_models import build_tiny_model
from twinkle_strategy.train.packing import (
    BatchLayout,
    DataCollatorForPacking,
    Pack,
    attention_length,
    check_packable,
    pack_examples,
    prepare_for_packed_batches,
    real_token_count,
)

FP32_TOLERANCE = 1e-5


def example(n: int, first: int = 1) -> dict[str, list[int]]:
    ids = [(first + i) % 100 + 1 for i in range(n)]
    return {"input_ids": ids, "labels": [-100] + ids[1:]}



def test_packs_fit_max_length_are_deterministic_and_keep_every_example():
    examples = [example(n, first=i) for i, n in enumerate([30, 3, 17, 9, 40, 5, 12, 26, 7, 44])]
    packs = pack_examples(examples, 48)
    assert all(len(p) <= 48 for p in packs)
    assert sorted(e["input_ids"] for p in packs for e in p.examples) == sorted(e["input_ids"] for e in examples)
    assert packs == pack_examples(examples, 48)  # the same packs on every rank and after a resume
    # Best-fit decreasing: 193 tokens in the fewest packs of 48 there can be.
    assert len(packs) == math.ceil(sum(len(e["input_ids"]) for e in examples) / 48) == 5


def test_collator_flattens_with_per_example_positions_and_no_mask():
    a, b = example(4), example(3, first=50)
    batch = DataCollatorForPacking()([Pack((a, b)), example(2, first=70)])
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, 9)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]
    # Every example's first label is -100: the last token of one example does not predict the next one's first.
    assert batch["labels"][0, [0, 4, 7]].tolist() == [-100] * 3
    assert real_token_count(batch) == 9
    assert attention_length(batch) == pytest.approx((16 + 9 + 4) / 9)
    assert BatchLayout.of(packing=False, padding_free=True).flattened
    assert not BatchLayout.of(packing=False, padding_free=False).flattened


def test_packed_logits_equal_each_example_alone_in_one_process():
    """transformers' own packed-sequence masks (sdpa) keep examples apart, once the KV cache is off."""
    model = build_tiny_model("qwen3_moe")
    examples = [example(n, first=7 * n) for n in (5, 11, 3)]
    batch = DataCollatorForPacking()(examples)
    with torch.no_grad():
        crossing = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        prepare_for_packed_batches(model)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in examples])
    assert (packed - alone).abs().max() <= FP32_TOLERANCE
    # With the cache on (transformers' default, in training too) the same batch attends across examples.
    assert (crossing - alone).abs().max() > 0.1


@pytest.mark.parametrize("family,reason", [
    ("qwen3_next", "its layers of type ['linear_attention'] mix tokens along the sequence"),
    ("qwen3_5_moe_vl", "its layers of type ['linear_attention']"),
    ("nemotron_h", "its layers of type ['linear_attention']"),
    ("jamba", "its layers of type ['linear_attention', 'mamba']"),
    ("gpt_oss", "GptOssModel.forward builds its attention masks without position_ids"),
])
def test_families_that_would_mix_packed_examples_are_refused_by_name(family, reason):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.testing.tiny_models import tiny_config

    config = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(PackingError, match=f"cannot train {config.get_text_config().model_type}: "
                                           + reason.replace("[", r"\[").replace("]", r"\]")):
        check_packable(model)


def test_a_refusal_names_the_option_of_the_front_end_that_asked_for_packing():
    """Issue 36: the library's refusal once told HF Trainer and swift users to set data.packing and --packing. The
    library names the batches; each front-end names its own option and how to turn it off."""
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.integrations.swift.parts.hooks import SWIFT_PACKING
    from twinkle_strategy.integrations.transformers.sequence import TRAINER_PACKING
    from twinkle_strategy.sequence.packed import PackingOption
    from twinkle_strategy.testing.tiny_models import tiny_config
    from twinkle_strategy.train.packing import RECIPE_PACKING

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_next"))
    for option, says in [(PackingOption(), "packed batches (position_ids restarting at every example)"),
                         (RECIPE_PACKING, "data.packing / data.padding_free"),
                         (SWIFT_PACKING, "--packing / --padding_free"),
                         (TRAINER_PACKING, "packed rows (DataCollatorWithFlattening, TRL's padding_free or packing)")]:
        with pytest.raises(PackingError) as raised:
            check_packable(model, option=option)
        assert str(raised.value).startswith(f"{says} cannot train qwen3_next: ") and \
            str(raised.value).endswith(f"; {option.turn_off}"), str(raised.value)
    library = str(pytest.raises(PackingError, check_packable, model).value)
    assert "data." not in library and "--" not in library, library


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "llama4"])
def test_attention_families_are_packable(family):
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.testing.tiny_models import tiny_config

    with torch.device("meta"):
        check_packable(AutoModelForCausalLM.from_config(tiny_config(family)))
