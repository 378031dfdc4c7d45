"""SFT data: chat-template tokenisation, response-only labels, packing, collation, clear errors."""

import json

import pytest

from twinkle_strategy.data import IGNORE_INDEX, DataCollatorForSFT, DatasetError, SFTDataset, load_jsonl
from twinkle_strategy.tiny_models import build_tokenizer


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
    trained = tokenizer.decode([t for t, l in zip(ex["input_ids"], ex["labels"]) if l != IGNORE_INDEX])
    assert trained == "2 plus 2 is 4.<|im_end|>\nhello world<|im_end|>\n"
    assert "system prompt" not in trained and "What is" not in trained
    ex = ds[1]
    assert tokenizer.decode([t for t, l in zip(ex["input_ids"], ex["labels"]) if l != IGNORE_INDEX]) == \
        "2 plus 2 is 4.<|im_end|>\n"


def test_max_length_packing_and_collation(tokenizer, tmp_path):
    rows = [{"query": "What is 2 plus 2?", "response": "2 plus 2 is 4."}] * 6
    path = write(tmp_path, rows)
    single = SFTDataset.from_jsonl(path, tokenizer, max_length=64)
    n = len(single[0]["input_ids"])
    packed = SFTDataset.from_jsonl(path, tokenizer, max_length=3 * n, packing=True)
    assert len(packed) == 2 and len(packed[0]["input_ids"]) == 3 * n
    assert packed[0]["labels"] == single[0]["labels"] * 3
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
