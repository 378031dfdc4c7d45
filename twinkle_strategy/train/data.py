"""SFT data: JSONL rows -> token ids with labels on the responses only -> padded batches (packed: packing.py).

A row is either ``{"messages": [{"role": ..., "content": ...}, ...]}`` (chat,
any number of turns) or ``{"query": ..., "response": ..., "system": ...}``.
Tokens come from the tokenizer's own chat template; only assistant turns are
trained on (every other label is -100), as in ms-swift.

Rows longer than ``max_length`` tokens, as swift's ``--truncation_strategy``: ``delete``
(swift's default, and twinkle-sft's) skips them; ``right`` (this module's default, as a
tokenizer truncates) keeps their first ``max_length`` tokens, ``left`` their last.

Bad rows, as in ``swift sft --strict false`` (the default): a row that cannot
become a training example (not JSON, no assistant turn, longer than ``max_length``
under ``delete``, nothing left to train on after truncation) is skipped, and one
warning counts the skipped rows and names the first few lines. ``strict=True`` raises on the first
bad row instead, naming its file and line. A file with no usable row is an error
either way.

Several files, and swift's sample count: ``["a.jsonl", "b.jsonl#100"]`` is all
of a.jsonl followed by 100 examples of b.jsonl, drawn as swift draws them: whole
copies of the file while 100 exceeds its size, then a seeded random subset
(without replacement) for the remainder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch

from twinkle_strategy.distributed.runtime import global_rank
from twinkle_strategy.errors import shorten
from twinkle_strategy.train.errors import DatasetError, RowError
from twinkle_strategy.train.packing import Pack, pack_examples

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
SHOWN_SKIPPED_ROWS = 5  # a warning names this many bad rows, then counts the rest
STRICT_FIX = "fix the row, or set data.strict=false (--strict false) to skip bad rows with a warning"


Messages = list[dict[str, str]]
TRUNCATION_STRATEGIES = ("delete", "right", "left")  # swift's, less 'split' (pre-training only)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One ``--dataset`` entry: a JSONL path, optionally with swift's ``#N`` sample count."""

    path: str
    sample: int | None = None

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        # Like swift: split at the last '#', unless the whole text names an existing file.
        if "#" not in text or os.path.exists(text):
            return cls(text)
        path, count = text.rsplit("#", 1)
        if not count.isdigit() or int(count) < 1:
            raise DatasetError(f"dataset {text!r}: after '#' comes the number of examples to use (swift's "
                               f"path#N, e.g. data.jsonl#1000), got {count!r}")
        return cls(path, int(count))


@dataclasses.dataclass(frozen=True)
class SkippedRow:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def read_rows(path: str, strict: bool = False,
              max_rows: int | None = None) -> tuple[list[tuple[int, Messages]], list[SkippedRow]]:
    """``(line number, messages)`` of each usable row of a JSONL file, and the rows skipped.

    ``strict`` raises :class:`DatasetError` on the first bad row instead of
    skipping it. ``max_rows`` stops after that many non-blank rows (a quick look
    at the start of a file).
    """
    if not os.path.exists(path):
        raise DatasetError(f"dataset file {path!r} does not exist")
    if os.path.isdir(path):
        raise DatasetError(f"dataset {path!r} is a directory; pass a JSONL file")
    rows: list[tuple[int, Messages]] = []
    skipped: list[SkippedRow] = []
    try:
        f = open(path, "rb")  # bytes: a line that is not UTF-8 is one bad row, not a failed file
    except OSError as exc:
        raise DatasetError(f"dataset file {path!r} cannot be read: {exc.strerror}") from exc
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if max_rows is not None and len(rows) + len(skipped) >= max_rows:
                break
            try:
                rows.append((lineno, to_messages(_parse_row(raw))))
            except RowError as exc:
                bad = SkippedRow(path, lineno, str(exc))
                if strict:
                    raise DatasetError(f"{bad}; {STRICT_FIX}") from exc
                skipped.append(bad)
    return rows, skipped


def _parse_row(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RowError(f"not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise RowError(f"not valid JSON ({exc.msg})") from exc


def load_jsonl(path: str, strict: bool = True) -> list[Messages]:
    """The conversations (lists of messages) of a JSONL file; by default every row must be usable."""
    rows, skipped = read_rows(path, strict=strict)
    if not rows:
        raise no_usable_row_error(path, skipped)
    return [messages for _, messages in rows]


def no_usable_row_error(path: str, skipped: list[SkippedRow]) -> DatasetError:
    if not skipped:
        return DatasetError(f"dataset file {path!r} has no rows")
    return DatasetError(f"dataset file {path!r} has no usable row: all {len(skipped)} rows were skipped, e.g. "
                        f"{skipped[0]}. Rows need 'messages' with an assistant turn, or 'query' and 'response'")


def to_messages(row: Any) -> Messages:
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise RowError("'messages' must be a list of {'role': ..., 'content': ...}")
    elif "query" in row and "response" in row:
        messages = [{"role": "user", "content": row["query"]}, {"role": "assistant", "content": row["response"]}]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise RowError(f"a row needs 'messages', or 'query' and 'response'; found keys {sorted(row)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no assistant message to train on")
    return messages


def _template_ids(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


def tokenize_conversation(tokenizer, messages: Messages) -> dict[str, list[int]]:
    """input_ids and labels of the whole conversation (:func:`fit_to_max_length` cuts or drops it); labels are
    -100 except on assistant turns."""
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
    return {"input_ids": input_ids, "labels": labels}


def fit_to_max_length(example: dict[str, list[int]], max_length: int,
                      truncation_strategy: str) -> dict[str, list[int]] | None:
    """``example`` within ``max_length`` tokens as swift's ``truncation_strategy`` does it; None: deleted."""
    if len(example["input_ids"]) <= max_length:
        return example
    if truncation_strategy == "delete":
        return None
    cut = slice(-max_length, None) if truncation_strategy == "left" else slice(max_length)
    return {key: ids[cut] for key, ids in example.items()}


def too_long_reason(length: int, max_length: int) -> str:
    return (f"{length} tokens, longer than max_length={max_length} (swift's default truncation_strategy delete drops "
            "such rows; raise data.max_length, or set data.truncation_strategy=right to cut them)")


def has_labels(example: dict[str, list[int]]) -> bool:
    """Whether a causal LM learns anything from ``example`` (the first label is never predicted)."""
    return any(label != IGNORE_INDEX for label in example["labels"][1:])


def sample_examples(examples: list, count: int, generator: torch.Generator) -> list:
    """swift's ``path#N``: whole copies of ``examples`` while N exceeds their number, then a
    random subset without replacement for the remainder."""
    copies, remainder = divmod(count, len(examples))
    picked = list(range(len(examples))) * copies
    picked += torch.randperm(len(examples), generator=generator)[:remainder].tolist()
    return [examples[i] for i in picked]


def load_examples(spec: DatasetSpec, tokenizer, max_length: int, strict: bool, generator: torch.Generator,
                  truncation_strategy: str = "right") -> tuple[list[dict[str, list[int]]], list[SkippedRow], int]:
    """Tokenized examples of one dataset entry, the rows skipped, and the number of rows read."""
    rows, skipped = read_rows(spec.path, strict=strict)
    rows_read = len(rows) + len(skipped)
    examples = []
    for lineno, messages in rows:
        whole = tokenize_conversation(tokenizer, messages)
        example = fit_to_max_length(whole, max_length, truncation_strategy)
        if example is not None and has_labels(example):
            examples.append(example)
            continue
        too_long = example is None
        reason = too_long_reason(len(whole["input_ids"]), max_length) if too_long else \
            f"nothing to train on after truncation to max_length={max_length} (the prompt fills it)"
        bad = SkippedRow(spec.path, lineno, reason)
        if strict:
            raise DatasetError(f"{bad}; {STRICT_FIX}" + ("" if too_long else ", or raise data.max_length"))
        skipped.append(bad)
    if not examples:
        raise no_usable_row_error(spec.path, skipped)
    if spec.sample is not None:
        examples = sample_examples(examples, spec.sample, generator)
    return examples, skipped, rows_read


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized examples; with ``packing``, :class:`~twinkle_strategy.train.packing.Pack` s of examples of at
    most ``max_length`` tokens in all (collate them with ``DataCollatorForPacking``: each example keeps its
    own attention).

    ``skipped`` lists the rows that could not be used (see the module docstring).
    """

    def __init__(self, examples: list[dict[str, list[int]]], max_length: int = 512, packing: bool = False,
                 skipped: list[SkippedRow] | None = None):
        self.examples: list[dict[str, list[int]] | Pack] = pack_examples(examples, max_length) if packing \
            else examples
        self.skipped = list(skipped or [])

    @classmethod
    def from_jsonl(cls, datasets: str | list[str], tokenizer, max_length: int = 512, packing: bool = False,
                   strict: bool = False, seed: int = 42, truncation_strategy: str = "right") -> SFTDataset:
        """One or more JSONL files (``path`` or swift's ``path#N``), concatenated in order.

        Every rank builds the same dataset: sampling is seeded with ``seed``. ``truncation_strategy``: what
        becomes of a row longer than ``max_length`` (see the module docstring).
        """
        if truncation_strategy not in TRUNCATION_STRATEGIES:
            raise DatasetError(f"truncation_strategy={truncation_strategy!r}; use one of {TRUNCATION_STRATEGIES}")
        specs = [DatasetSpec.parse(d) for d in ([datasets] if isinstance(datasets, str) else datasets)]
        if not specs:
            raise DatasetError("no dataset given; pass one or more JSONL files")
        generator = torch.Generator().manual_seed(seed)
        examples, skipped, rows = [], [], 0
        for spec in specs:
            spec_examples, spec_skipped, spec_rows = load_examples(spec, tokenizer, max_length, strict, generator,
                                                                   truncation_strategy)
            examples += spec_examples
            skipped += spec_skipped
            rows += spec_rows
        dataset = cls(examples, max_length, packing, skipped)
        if skipped and _is_first_rank():  # every rank reads the same rows: warn once
            logger.warning(skipped_rows_warning(skipped, rows, len(examples)))
        return dataset

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, list[int]] | Pack:
        return self.examples[index]


def skipped_rows_warning(skipped: list[SkippedRow], rows: int, examples: int) -> str:
    shown = shorten(skipped, SHOWN_SKIPPED_ROWS, "; ")
    return (f"skipped {len(skipped)} of {rows} dataset rows that cannot become a training example ({shown}); "
            f"training on {examples} examples. Set data.strict=true (--strict true) to stop at the first bad row")


def _is_first_rank() -> bool:
    return global_rank() == 0


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


class StepSampler:
    """The dataset rows each optimizer step trains on, the same on every rank whatever the number of ranks.

    Each epoch is a permutation of the dataset seeded with ``seed + epoch``, cut into consecutive global
    batches of ``per_step`` rows (a last partial batch is dropped). A rank takes its share of each
    micro-batch of a step (see :meth:`Trainer._micro_batches`).
    """

    def __init__(self, num_rows: int, *, per_step: int, seed: int) -> None:
        self.num_rows, self.per_step, self.seed = num_rows, per_step, seed
        self.steps_per_epoch = num_rows // per_step
        self._epoch: int | None = None
        self._order: list[int] = []

    def rows(self, step: int) -> list[int]:
        """Dataset indices of step ``step``'s global batch (0-based step), micro-batch after micro-batch."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if self._epoch != epoch:  # one permutation per epoch, not per step
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._order = torch.randperm(self.num_rows, generator=generator).tolist()
            self._epoch = epoch
        return self._order[index * self.per_step:(index + 1) * self.per_step]
