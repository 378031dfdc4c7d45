"""What twinkle_strategy takes from TRL's internals: the private steps of ``GRPOTrainer`` its mixin overrides.

TRL has no public hook for how ``GRPOTrainer`` generates (``use_vllm=False``), scores and prepares its batches;
:class:`~twinkle_strategy.integrations.transformers.grpo.StrategyGRPOTrainerMixin` overrides those steps and
calls TRL's own through :func:`grpo_parent`. :func:`check_grpo_overrides` runs when the trainer class is built: an
override of a renamed step would silently never run. With ``use_vllm=True`` (colocate),
:mod:`~twinkle_strategy.integrations.transformers.grpo_vllm` replaces TRL's ``VLLMGeneration.sync_weights`` and
reads its engine. Its log line's ``aux_loss`` is replaced through :func:`replace_logged_metric`. Each is checked in
``tests/unit/test_internals.py``.
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


# -- GRPOTrainer's log line: the metrics it collects while training, averaged into its next line
GRPO_METRICS = Internal("GRPOTrainer._metrics", "trl", checked=_CHECKED,
                        replacement="none: GRPOTrainer's log line averages its own lists, with no hook for a value",
                        used_for="log the global-batch aux loss the step trained on as aux_loss, in place of TRL's "
                                 "mean over ranks of each rank's own term")


def replace_logged_metric(trainer, name: str, value: float) -> None:
    """Make ``trainer``'s (TRL's ``GRPOTrainer``) next training log line carry ``value`` as ``name``, in place of
    the values TRL collected for it since its last line (the line logs their mean)."""
    metrics = GRPO_METRICS.attribute(trainer, "_metrics")
    if not isinstance(metrics, dict) or "train" not in metrics:
        raise GRPO_METRICS.changed("is no longer a dict of lists by mode ('train', 'eval')")
    metrics["train"][name] = [value]


GRPO_METRICS.wrapper(replace_logged_metric)


# -- TRL's vLLM backend (GRPOTrainer(use_vllm=True)): its colocated engine and the weight sync replaced
_VLLM_GENERATION = "none: GRPOTrainer takes no weight-sync callback for its vLLM backend"
VLLM_SYNC = Internal("VLLMGeneration.sync_weights", "trl", checked=_CHECKED, replacement=_VLLM_GENERATION,
                     used_for="replace the colocated engine's weight sync (a bare load_weights per parameter, wrong "
                              "for MoE after the first sync) with strategy.export_weights into vLLM's reload")
VLLM_ENGINE = Internal("VLLMGeneration.llm", "trl", checked=_CHECKED, replacement=_VLLM_GENERATION,
                       used_for="reach the vLLM engine TRL's colocate mode holds on each rank, to load the export")
VLLM_CLIENT = Internal("VLLMGeneration.vllm_client", "trl", checked=_CHECKED, replacement=_VLLM_GENERATION,
                       used_for="reach the VLLMClient TRL's server mode holds on the main process, to send the export")
VLLM_SLEEPING = Internal("VLLMGeneration._llm_weights_sleeping", "trl", checked=_CHECKED, replacement=_VLLM_GENERATION,
                         used_for="wake a sleeping colocated engine's weights before the sync, as TRL's own does")


def replace_vllm_sync(generation, sync) -> None:
    """Make ``generation`` (TRL's ``VLLMGeneration``) call ``sync()`` wherever it would sync its engine's weights
    (TRL calls ``vllm_generation.sync_weights()`` before generating at a new step, and from ``generate`` after
    sleep mode dropped the weights)."""
    if not callable(getattr(type(generation), "sync_weights", None)):
        raise VLLM_SYNC.changed()
    generation.sync_weights = sync  # the instance's attribute: every caller goes through it


def colocated_engine(generation):
    """The ``vllm.LLM`` TRL's colocate mode started on this rank."""
    return VLLM_ENGINE.attribute(generation, "llm")


def server_client(generation):
    """The ``VLLMClient`` TRL's server mode connected on the main process (its NCCL communicator initialised)."""
    return VLLM_CLIENT.attribute(generation, "vllm_client")


def wake_colocated_weights(generation) -> None:
    """What TRL's own sync does first under ``vllm_enable_sleep_mode``: map the engine's weights back in."""
    if getattr(generation, "enable_sleep_mode", False):
        VLLM_SLEEPING.attribute(generation, "_llm_weights_sleeping")
        colocated_engine(generation).wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False


VLLM_SYNC.wrapper(replace_vllm_sync)
VLLM_ENGINE.wrapper(colocated_engine)
VLLM_CLIENT.wrapper(server_client)
VLLM_SLEEPING.wrapper(wake_colocated_weights)
