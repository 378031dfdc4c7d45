"""What Ulysses can serve, decided from the model's config before any weight is read.

* Query heads must divide by sequence_parallel_size (each rank takes whole heads). KV heads need not:
  GQA with fewer KV heads than ranks replicates them (:mod:`.attention`).
* Layers that carry state along the sequence (linear attention, Mamba, causal convolutions) would
  restart their state at each chunk: refused by name.
* Attention sinks (gpt-oss, DeepSeek-V4) are per-head parameters the core function adds to the softmax;
  cutting them by heads is not done yet: refused by name.
"""

from __future__ import annotations

from twinkle_strategy.errors import ParallelConfigError
from twinkle_strategy.sequence.packed import PACKABLE_LAYER_TYPES

# Layer kinds of ``config.layer_types`` that attention by heads covers, or that do not mix tokens: those packed
# rows serve, except chunked attention (Llama 4), which the Ulysses attention function does not mask (refused).
_ATTENTION_LAYERS = PACKABLE_LAYER_TYPES - {"chunked_attention"}
# Families whose layers carry state along the sequence without saying so in layer_types, and families with sinks,
# by the checkpoint's model_type or its text model's (a vision-language checkpoint's text config is ``<family>_text``).
_STATEFUL_FAMILIES = {"nemotron_h": "Mamba-2 layers", "jamba": "Mamba layers", "falcon_h1": "Mamba-2 layers",
                      "granitemoehybrid": "Mamba-2 layers", "qwen3_next": "Gated DeltaNet linear attention",
                      "qwen3_5_moe": "Gated DeltaNet linear attention", "lfm2_moe": "short convolutions"}
_SINK_FAMILIES = {"gpt_oss": "attention sinks", "deepseek_v4": "attention sinks"}


def _family_reason(model_types: list[str]) -> str | None:
    for model_type in model_types:
        base = model_type.removesuffix("_text")
        reason = _STATEFUL_FAMILIES.get(base) or _SINK_FAMILIES.get(base)
        if reason is not None:
            return reason
    return None


def check_sequence_parallel(config, sequence_parallel_size: int) -> None:
    """Raise :class:`ParallelConfigError` naming the constraint when ``config``'s model cannot be split."""
    sp = sequence_parallel_size
    if sp == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_types = [t for t in (getattr(config, "model_type", None), getattr(text, "model_type", None)) if t]
    family = model_types[0].removesuffix("_text") if model_types else "?"  # the checkpoint's own family
    reason = _family_reason(model_types)
    other_layers = sorted(set(getattr(text, "layer_types", None) or []) - _ATTENTION_LAYERS)
    if reason is None and other_layers:
        reason = f"layers of type {other_layers}"
    if reason is not None:
        raise ParallelConfigError(f"sequence_parallel_size={sp}: {family} has {reason}, which Ulysses sequence "
                                  "parallelism cannot split along the sequence; use sequence_parallel_size=1")
    heads = getattr(text, "num_attention_heads", None)
    if isinstance(heads, int) and heads % sp != 0:
        choices = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ParallelConfigError(f"sequence_parallel_size={sp} must divide the {heads} attention heads of "
                                  f"{family} (each rank attends with whole heads); choose it among {choices}")


def refuse_generation(model, sequence_parallel_size: int) -> None:
    """Make ``model.generate`` raise one line: decoding one token at a time has no sequence to cut in chunks, and
    the KV cache of a chunk would hold only its own keys."""
    def generate(*args, **kwargs):
        raise ParallelConfigError(
            f"generate does not run under sequence parallelism (sequence_parallel_size={sequence_parallel_size}): "
            "each rank holds a chunk of every sequence, and decoding extends whole sequences; generate with a "
            "strategy whose sequence_parallel_size is 1 (rollouts), and train with sequence parallelism")

    model.generate = generate
