"""Checks on the launching machine, before any process or process group starts.

A wrong path found by the workers costs a whole launch: every rank imports torch,
loads the model, and prints the same traceback. What can be checked here is checked
here: the dataset files (they exist, can be read, and their first rows can be trained
on), the model (a local checkpoint, or an ``hf://``/``ms://`` id already in its hub's
cache, has config.json and safetensors weights), the output directory (writable) and
the checkpoint to resume from (exists). Each failure is a :class:`PreflightError`
naming the recipe key and the fix, and nothing is written.

Left to the run, because only it can tell: ``hf://``/``ms://`` ids not in the local
cache yet (each node's source downloads them), rows after the first
``ROWS_CHECKED``, and single rows that turn out empty once tokenized and truncated (when
every checked row does, ``data.max_length`` is reported here, the tokenizer permitting).
"""

from __future__ import annotations

import os
import tempfile

from twinkle_strategy.loading import checkpoint_files_problem
from twinkle_strategy.sources.model_ids import HF_PREFIX, MS_PREFIX, TINY_PREFIX, cached_model_path
from twinkle_strategy.train.data import (
    DatasetError,
    DatasetSpec,
    fit_to_max_length,
    has_labels,
    no_usable_row_error,
    read_rows,
    tokenize_conversation,
)
from twinkle_strategy.train.demo_model import demo_tokenizer
from twinkle_strategy.train.errors import PreflightError
from twinkle_strategy.train.recipe import Recipe

ROWS_CHECKED = 100  # rows read per dataset file here; the run reads them all


def check_before_launch(recipe: Recipe) -> None:
    """Raise :class:`PreflightError` for the first problem found in ``recipe``'s paths."""
    check_datasets(recipe.data.dataset, recipe.data.strict)
    check_model(recipe.model.path)
    check_max_length(recipe)
    check_output_dir(recipe.train.output_dir)
    resume = recipe.train.resume_from_checkpoint
    if resume and not os.path.isdir(resume):
        raise PreflightError("train.resume_from_checkpoint",
                             f"{resume!r} does not exist; pass a checkpoint-N directory or a run directory")


def check_datasets(datasets: list[str], strict: bool) -> None:
    for text in datasets:
        try:
            spec = DatasetSpec.parse(text)
            rows, skipped = read_rows(spec.path, strict=strict, max_rows=ROWS_CHECKED)
            if not rows:
                raise no_usable_row_error(spec.path, skipped)
        except DatasetError as exc:
            raise PreflightError("data.dataset", f"{exc} (checked the first {ROWS_CHECKED} rows; relative paths "
                                                 f"start at {os.getcwd()})") from exc


def check_max_length(recipe: Recipe) -> None:
    """No checked row survives ``data.max_length`` (each dropped as longer, or truncated to nothing to train on,
    as ``data.truncation_strategy`` says): the run would have no example."""
    tokenizer = _tokenizer(recipe.model.path, recipe.data.dataset)
    if tokenizer is None:
        return
    max_length, strategy, whole = recipe.data.max_length, recipe.data.truncation_strategy, []
    for text in recipe.data.dataset:
        path = DatasetSpec.parse(text).path
        rows, _ = read_rows(path, strict=False, max_rows=ROWS_CHECKED)
        for _, messages in rows:
            try:
                example = tokenize_conversation(tokenizer, messages)
            except DatasetError:
                return  # the run reports a template that cannot mask labels
            fitted = fit_to_max_length(example, max_length, strategy)
            if fitted is not None and has_labels(fitted):
                return
            whole.append(len(example["input_ids"]))
    if whole:
        what = ("drops every row as longer (truncation_strategy delete, swift's default)" if strategy == "delete"
                else "truncates every row to nothing to train on")
        raise PreflightError("data.max_length", f"max_length={max_length} {what}; the first {ROWS_CHECKED} rows of "
                                                f"each dataset need up to {max(whole)} tokens: raise it, e.g. "
                                                f"--max_length {max(whole)}")


def _tokenizer(path: str, datasets: list[str]):
    """The tokenizer the run will use, where it can be had without downloading or writing anything."""
    if path.startswith(TINY_PREFIX):
        built = os.path.abspath(os.path.join("output", "tiny", path[len(TINY_PREFIX):] or "demo"))
        if not os.path.isfile(os.path.join(built, "config.json")):
            return demo_tokenizer([DatasetSpec.parse(d).path for d in datasets])
        path = built
    elif path.startswith((HF_PREFIX, MS_PREFIX)):
        path = cached_model_path(path)
        if path is None:
            return None
    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - the run loads it and reports why it cannot
        return None


def check_model(path: str) -> None:
    if path.startswith(TINY_PREFIX):  # built by this project on first use
        return
    if path.startswith((HF_PREFIX, MS_PREFIX)):
        local = cached_model_path(path)
        if local is None:
            if path.startswith(HF_PREFIX) and _hf_offline():
                raise PreflightError("model.path", f"{path} is not in the Hugging Face cache "
                                                   f"({_hf_cache_dir()}) and HF_HUB_OFFLINE=1 forbids downloading "
                                                   f"it; download it first (hf download {path[len(HF_PREFIX):]}) "
                                                   "or unset HF_HUB_OFFLINE")
            return  # not cached yet: each node's source downloads it
        problem = checkpoint_files_problem(local)
        if problem:
            raise PreflightError("model.path", f"the cached snapshot of {path}: {problem}; delete it from the cache "
                                               "to download it again")
        return
    problem = checkpoint_files_problem(path)
    if problem:
        raise PreflightError("model.path", f"{problem}; pass a local checkpoint directory, 'hf://org/name' or "
                                           "'ms://org/name'")


def check_output_dir(output_dir: str) -> None:
    path = os.path.abspath(output_dir)
    existing = path
    while not os.path.exists(existing):  # the nearest directory that exists: the run creates the rest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PreflightError("train.output_dir", f"{output_dir!r} cannot be created: {existing!r} is a file, not a "
                                                 "directory; pass another directory")
    try:
        # Create and delete a file: the only test that sees read-only mounts, ACLs and root squash alike.
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise PreflightError("train.output_dir", f"{output_dir!r} is not writable ({existing!r}: {exc.strerror}); "
                                                 "pass a directory you can write to") from exc


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hf_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE
