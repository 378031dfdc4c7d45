"""What twinkle_strategy takes from TRL's internals: the private steps of ``GRPOTrainer`` its mixin overrides.

TRL has no public hook for how ``GRPOTrainer`` generates (``use_vllm=False``), scores and prepares its batches;
:class:`~twinkle_strategy.integrations.transformers.grpo.StrategyGRPOTrainerMixin` overrides those steps and
calls TRL's own through :func:`grpo_parent`. :func:`check_grpo_overrides` runs when the trainer class is built: an
override of a renamed step would silently never run. Each is checked in ``tests/unit/test_internals.py``.
Nothing here imports TRL at import time.
"""

from __future__ import annotations

from twinkle_strategy.compat.registry import Internal

_CHECKED = "1.16.0"


def _grpo_step(name: str, used_for: str) -> Internal:
    return Internal(f"GRPOTrainer.{name}", "trl", used_for=used_for, checked=_CHECKED,
                    replacement="none: GRPOTrainer has no public hook for its generation, scoring and batches")


# name -> (the internal, its parameters after self, as the mixin's override takes them)
GRPO_STEPS = {internal.name.split(".", 1)[1]: internal for internal in (
    _grpo_step("_generate_single_turn", "generate the rollouts on every rank through strategy.generate (synced "
                                        "steps, the PEFT root unsharded) and record what they routed (R3)"),
    _grpo_step("_generate_and_score_completions", "carry the rollouts' routing record with the batch they score"),
    _grpo_step("_get_per_token_logps_and_entropies", "replay (R3) or record (R2) the routing in the old policy's "
                                                     "logprob forwards, chunk by chunk; keep the loss forward's "
                                                     "logprobs for the rollout mismatch telemetry"),
    _grpo_step("_prepare_inputs", "count the generated batch's tokens and mask its padding in the expert load"),
)}
GRPO_PARAMETERS = {
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
    "_generate_and_score_completions": ["inputs"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"],
    "_prepare_inputs": ["generation_batch"],
}


def check_grpo_overrides(mixin: type) -> None:
    """Raise if the installed TRL's ``GRPOTrainer`` no longer has a step ``mixin`` overrides, with the parameters the
    override passes on."""
    import inspect

    from trl import GRPOTrainer

    for name, internal in GRPO_STEPS.items():
        if name not in vars(mixin):
            continue
        if not hasattr(GRPOTrainer, name):
            raise internal.changed("is gone, so its override would never run")
        theirs = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)[1:]
        if theirs[:len(GRPO_PARAMETERS[name])] != GRPO_PARAMETERS[name]:
            raise internal.changed(f"takes {theirs}, not {GRPO_PARAMETERS[name]} first")


def grpo_parent(trainer, mixin: type, name: str):
    """The bound ``name`` of the class after ``mixin`` in ``trainer``'s MRO (TRL's ``GRPOTrainer`` step)."""
    return GRPO_STEPS[name].attribute(super(mixin, trainer), name)


for _internal in GRPO_STEPS.values():
    _internal.wrapper(check_grpo_overrides)
    _internal.wrapper(grpo_parent)
