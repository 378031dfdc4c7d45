"""SFT data: chat-template tokenisation, response-only labels, packing, collation, clear errors."""

import json

import pytest
import torch

from twinkle_strategy.train.data import (
    IGNORE_INDEX,
    DataCollatorForSFT,
    DatasetError,
    DatasetSpec,
    SFTDataset,
    StepSampler,
    load_jsonl,
)
from twinkle_strategy.train.demo_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["What is 2 plus 2?", "2 plus 2 is 4.", "hello world", "system prompt"], vocab_size=300)


def write(tmp_path, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) if not isinstance(r, str) else r for r in rows) + "\n")
    return str(path)


def test_labels_cover_only_assistant_turns(tokenizer, tmp_path):
    path = write(tmp_path, [{"messages": [{"role": "system", "content": "system prompt"},
                                          {"role": "user", "content": "hello world"},
                                          {"role": "assistant", "content": "2 plus 2 is 4."},
                                          {"role": "user", "content": "What is 2 plus 2?"},
                                          {"role": "assistant", "content": "hello world"}]},
                            {"query": "What is 2 plus 2?", "response": "2 plus 2 is 4."}])
    ds = SFTDataset.from_jsonl(path, tokenizer, max_length=512)
    assert len(ds) == 2
    ex = ds[0]
    trained = tokenizer.decode([t for t, l in zip(ex["input_ids"], ex["labels"], strict=False) if l != IGNORE_INDEX])
    assert trained == "2 plus 2 is 4.<|im_end|>\nhello world<|im_end|>\n"
    assert "system prompt" not in trained and "What is" not in trained
    ex = ds[1]
    assert tokenizer.decode([t for t, l in zip(ex["input_ids"], ex["labels"], strict=False) if l != IGNORE_INDEX]) == \
        "2 plus 2 is 4.<|im_end|>\n"


def test_max_length_packing_and_collation(tokenizer, tmp_path):
    rows = [{"query": "What is 2 plus 2?", "response": "2 plus 2 is 4."}] * 6
    path = write(tmp_path, rows)
    single = SFTDataset.from_jsonl(path, tokenizer, max_length=64)
    n = len(single[0]["input_ids"])
    packed = SFTDataset.from_jsonl(path, tokenizer, max_length=3 * n, packing=True)
    # Packs keep their examples apart (tests/multiproc/test_packing.py): three whole examples each.
    assert len(packed) == 2 and len(packed[0]) == 3 * n and packed[0].examples == (single[0],) * 3
    truncated = SFTDataset.from_jsonl(path, tokenizer, max_length=n - 2)
    assert len(truncated[0]["input_ids"]) == n - 2
    batch = DataCollatorForSFT(tokenizer.pad_token_id)([single[0], truncated[0]])
    assert batch["input_ids"].shape == (2, n)
    assert batch["attention_mask"][1].tolist() == [1] * (n - 2) + [0, 0]
    assert batch["labels"][1, -2:].tolist() == [IGNORE_INDEX] * 2
    assert (batch["input_ids"][1, -2:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("line,message", [
    ("{not json", "d.jsonl:2: not valid JSON"),
    (json.dumps({"text": "x"}), "d.jsonl:2: a row needs 'messages', or 'query' and 'response'; found keys ['text']"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "d.jsonl:2: no assistant message to train on"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    path = write(tmp_path, [{"query": "a", "response": "b"}, line])
    with pytest.raises(DatasetError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_jsonl(path)


def test_missing_dataset_file():
    with pytest.raises(DatasetError, match="dataset file '/no/such.jsonl' does not exist"):
        load_jsonl("/no/such.jsonl")


LONG_PROMPT = "hello world " * 60  # more than max_length=64 tokens: nothing of the response survives truncation


def twenty_rows_three_bad(tmp_path, name="d.jsonl"):
    """Rows 4 (not JSON), 9 (no assistant turn) and 15 (empty after truncation) cannot be trained on."""
    lines = [json.dumps({"query": f"What is {i} plus 2?", "response": "2 plus 2 is 4."}) for i in range(20)]
    lines[3] = '{"query": "What is 2 plus 2?", "response": '
    lines[8] = json.dumps({"messages": [{"role": "user", "content": "hello world"}]})
    lines[14] = json.dumps({"query": LONG_PROMPT, "response": "2 plus 2 is 4."})
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_rows_are_skipped_with_one_warning(tokenizer, tmp_path, caplog):
    path = twenty_rows_three_bad(tmp_path)
    ds = SFTDataset.from_jsonl(path, tokenizer, max_length=64)
    assert len(ds) == 17
    assert [(s.line, s.reason.split(" (")[0]) for s in ds.skipped] == [
        (4, "not valid JSON"), (9, "no assistant message to train on"),
        (15, "nothing to train on after truncation to max_length=64")]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "skipped 3 of 20 dataset rows" in warnings[0] and "training on 17 examples" in warnings[0]
    for line in (4, 9, 15):
        assert f"d.jsonl:{line}: " in warnings[0]


def test_strict_stops_at_the_first_bad_row(tokenizer, tmp_path):
    path = twenty_rows_three_bad(tmp_path)
    with pytest.raises(DatasetError, match=r"d.jsonl:4: not valid JSON .*set data.strict=false"):
        SFTDataset.from_jsonl(path, tokenizer, max_length=64, strict=True)
    # A row that only turns out empty once tokenized stops a strict run too.
    only_long = write(tmp_path, [{"query": "hello world", "response": "hello world"},
                                 {"query": LONG_PROMPT, "response": "2 plus 2 is 4."}])
    with pytest.raises(DatasetError, match="d.jsonl:2: nothing to train on after truncation to max_length=64"):
        SFTDataset.from_jsonl(only_long, tokenizer, max_length=64, strict=True)


def test_a_dataset_without_usable_rows_is_an_error(tokenizer, tmp_path):
    path = write(tmp_path, ["{oops", json.dumps({"text": "x"})])
    with pytest.raises(DatasetError, match=r"has no usable row: all 2 rows were skipped, e.g. .*d.jsonl:1: not valid"):
        SFTDataset.from_jsonl(path, tokenizer, max_length=64)


def test_several_datasets_and_swift_sample_counts(tokenizer, tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps({"query": "What is 2 plus 2?", "response": f"{i} plus 2"}) + "\n"
                         for i in range(3)))
    b = tmp_path / "b#2.jsonl"  # an existing file whose name holds '#' is taken as it is, as swift does
    b.write_text("".join(json.dumps({"query": "hello world", "response": f"{i} world"}) + "\n" for i in range(2)))
    single = {str(p): [tuple(e["input_ids"]) for e in SFTDataset.from_jsonl(str(p), tokenizer, 64)] for p in (a, b)}

    ds = SFTDataset.from_jsonl([str(a), f"{b}#5"], tokenizer, max_length=64, seed=1)
    ids = [tuple(e["input_ids"]) for e in ds]
    assert ids[:3] == single[str(a)]  # a.jsonl whole, then 5 examples of b
    # 5 > 2 rows: two whole copies, then one more drawn without replacement.
    assert sorted(ids[3:].count(x) for x in single[str(b)]) == [2, 3]
    again = SFTDataset.from_jsonl([str(a), f"{b}#5"], tokenizer, max_length=64, seed=1)
    assert [tuple(e["input_ids"]) for e in again] == ids  # every rank draws the same

    subset = [tuple(e["input_ids"]) for e in SFTDataset.from_jsonl(f"{a}#2", tokenizer, max_length=64)]
    assert len(subset) == 2 and len(set(subset)) == 2 and set(subset) <= set(single[str(a)])


@pytest.mark.parametrize("spec", ["data.jsonl#0", "data.jsonl#ten"])
def test_bad_sample_count(spec):
    with pytest.raises(DatasetError, match="after '#' comes the number of examples to use"):
        DatasetSpec.parse(spec)


def test_each_step_trains_on_its_own_rows_of_a_seeded_permutation_per_epoch():
    sampler = StepSampler(10, per_step=4, seed=3)
    assert sampler.steps_per_epoch == 2  # the last partial global batch of an epoch is dropped
    epoch0, epoch1 = (torch.randperm(10, generator=torch.Generator().manual_seed(3 + e)).tolist() for e in (0, 1))
    assert [sampler.rows(step) for step in range(4)] == [epoch0[:4], epoch0[4:8], epoch1[:4], epoch1[4:8]]
    assert sampler.rows(1) == epoch0[4:8]  # any step, in any order
