"""SFT data: JSONL rows -> token ids with labels on the responses only -> padded batches.

A row is either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat,
any number of turns) or ``{"query": ..., "response": ..., "system": ...}``.
Tokens come from the tokenizer's own chat template; only assistant turns are
trained on (every other label is -100), as in ms-swift.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

IGNORE_INDEX = -100


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; names the file and line."""


def load_jsonl(path: str) -> list[list[dict[str, str]]]:
    """Read a JSONL file into a list of conversations (lists of messages)."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path!r} does not exist")
    conversations = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            conversations.append(to_messages(row, f"{path}:{lineno}"))
    if not conversations:
        raise DatasetError(f"dataset file {path!r} has no rows")
    return conversations


def to_messages(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise DatasetError(f"{where}: 'messages' must be a list of {{'role': ..., 'content': ...}}")
    elif "query" in row and "response" in row:
        messages = [{"role": "user", "content": row["query"]}, {"role": "assistant", "content": row["response"]}]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise DatasetError(f"{where}: a row needs 'messages', or 'query' and 'response'; found keys {sorted(row)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"{where}: no assistant message to train on")
    return messages


def _template_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_length: int) -> dict[str, list[int]]:
    """input_ids and labels; labels are -100 except on assistant turns."""
    input_ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _template_ids(tokenizer, messages[:i], add_generation_prompt=True)
        full = _template_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(input_ids)] != input_ids or full[: len(prompt)] != prompt:
            raise DatasetError("the tokenizer's chat template does not extend earlier turns; cannot mask labels")
        labels += [IGNORE_INDEX] * (len(prompt) - len(input_ids)) + full[len(prompt):]
        input_ids = full
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length]}


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized conversations, optionally packed into sequences of ``max_length`` tokens."""

    def __init__(self, conversations, tokenizer, max_length: int = 512, packing: bool = False):
        examples = [tokenize_conversation(tokenizer, m, max_length) for m in conversations]
        examples = [e for e in examples if any(l != IGNORE_INDEX for l in e["labels"][1:])]
        if packing:
            examples = pack(examples, max_length)
        self.examples = examples

    @classmethod
    def from_jsonl(cls, path: str, tokenizer, max_length: int = 512, packing: bool = False) -> "SFTDataset":
        return cls(load_jsonl(path), tokenizer, max_length, packing)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.examples[index]


def pack(examples: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Greedily concatenate examples into sequences of at most ``max_length`` tokens.

    Without a padding-free attention kernel, packed examples can attend to each
    other; that is the usual trade-off of simple packing.
    """
    packed, ids, labels = [], [], []
    for e in examples:
        if ids and len(ids) + len(e["input_ids"]) > max_length:
            packed.append({"input_ids": ids, "labels": labels})
            ids, labels = [], []
        ids, labels = ids + e["input_ids"], labels + e["labels"]
    if ids:
        packed.append({"input_ids": ids, "labels": labels})
    return packed


class DataCollatorForSFT:
    """Pad a list of examples on the right: input_ids with pad_token_id, labels with -100."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(features), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(features), length), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            labels[i, :n] = torch.tensor(f["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
