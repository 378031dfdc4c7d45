"""Resolving model ids and loading checkpoints strictly.

``from_pretrained`` in transformers quietly re-initialises tensors that are
missing from a checkpoint and re-initialises mismatched ones when asked to
ignore them. Training on such weights is exactly the silent failure we exist
to prevent, so every load here asks transformers for its loading report and
turns missing or mismatched tensors into a :class:`CheckpointError` that names them.
"""

from __future__ import annotations

import os

import torch

from twinkle_strategy.errors import CheckpointError  # noqa: F401  (raised here, importable from here)


def resolve_model_path(path_or_id: str) -> str:
    """A local directory for ``path_or_id``: a local path, ``ms://org/name`` (ModelScope) or ``hf://org/name``."""
    if path_or_id.startswith("ms://"):
        from modelscope import snapshot_download

        return snapshot_download(path_or_id[len("ms://"):])
    if path_or_id.startswith("hf://"):
        from huggingface_hub import snapshot_download

        return snapshot_download(path_or_id[len("hf://"):])
    if not os.path.isdir(path_or_id):
        raise CheckpointError(
            f"model path {path_or_id!r} does not exist or is not a directory; pass a local checkpoint directory, "
            "'ms://org/name' for ModelScope or 'hf://org/name' for the Hugging Face Hub"
        )
    return path_or_id


def load_pretrained_strict(path: str, dtype: torch.dtype, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` on CPU that refuses missing or mismatched tensors."""
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("ignore_mismatched_sizes", True)  # report them ourselves, by name
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True, **kwargs)
    except Exception as exc:  # noqa: BLE001 - safetensors, OS and transformers errors alike
        raise CheckpointError(
            f"could not load the checkpoint in {path}: {type(exc).__name__}: {exc}. A file may be truncated or "
            "corrupt (re-download or re-export it), or the directory is not a transformers checkpoint"
        ) from exc
    raise_for_loading_info(path, info)
    return model


def raise_for_loading_info(path: str, info: dict) -> None:
    """Raise :class:`CheckpointError` naming every missing or wrong-shaped tensor of a transformers loading report
    (``from_pretrained(..., output_loading_info=True, ignore_mismatched_sizes=True)``)."""
    problems = []
    for key, ckpt_shape, model_shape in sorted(info.get("mismatched_keys", ())):
        problems.append(f"tensor '{key}' has shape {tuple(ckpt_shape)} in the checkpoint but the model "
                        f"expects {tuple(model_shape)}")
    for key in sorted(info.get("missing_keys", ())):
        problems.append(f"tensor '{key}' is missing from the checkpoint")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(
            f"checkpoint {path} does not match its config.json: {shown}. "
            "Re-export the checkpoint, or fix config.json so the shapes agree"
        )
