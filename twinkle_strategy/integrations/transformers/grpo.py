"""TRL's ``GRPOTrainer`` through NativeFSDPStrategy, generating with the policy itself, with routing replay.

    trainer = with_strategy(GRPOTrainer)(model=model, args=GRPOConfig(...), reward_funcs=reward,
                                         train_dataset=prompts, strategy=strategy)   # routing_replay="r3"

:func:`~twinkle_strategy.integrations.transformers.with_strategy` picks :class:`StrategyGRPOTrainerMixin` for
``GRPOTrainer`` and its subclasses. What it changes in TRL's loop (``use_vllm=False``):

* **Generation** goes through ``strategy.generate`` (:mod:`twinkle_strategy.rl.generation`): every rank takes every
  decoding step (``synced_gpus``; each forward is collective under FSDP2 and EP), and a PEFT model's root stays
  unsharded for the call. TRL's own path would call ``generate`` past the module FSDP2 made the root.
* **R3** (``routing_replay="r3"``, the default for MoE models whose routers replay can force): ``generate`` returns
  what it routed; the record, padded as TRL pads the prompts (left) and completions (right), travels with the
  batch under ``routed_experts``, and every later forward of those sequences by the policy (the old policy's
  logprobs, each update) dispatches the experts the rollout used. The reference model (``beta > 0``; a LoRA run's
  base model) is another policy and routes freely, as in plain TRL.
* **R2** (``routing_replay="r2"``): the old policy's logprob forward records its routing, the update forwards of
  the same batch replay it. TRL runs that forward only when the batch is reused
  (``num_iterations > 1``, or ``steps_per_generation`` above ``gradient_accumulation_steps``); on-policy steps
  have nothing to replay.
* **The load-balancing loss** is counted over the global batch (:mod:`.aux_loss`), and the ``aux_loss`` each log
  line carries is that loss, the one the steps trained on (the same on every rank), not TRL's mean of each rank's own.
* **Telemetry:** each log line carries ``routing_agreement_min`` and ``routing_agreement_mean``, the share of
  replayed tokens (per MoE layer: the least and the mean) whose recorded experts are those the trainer's router
  would have chosen itself (:class:`~.trainer.StrategyTrainerMixin`), in the update forwards (the scoring
  forwards are left out: the reference, LoRA's base model, routes otherwise by design). When the batch carries
  the rollout engine's logprobs (TRL's ``sampling_per_token_logps``, from vLLM, or a ``rollout_logprobs`` key),
  each step also logs ``rollout/logprob_abs_diff`` and ``rollout/kl_k3``: the mean absolute difference and the k3
  KL between them and the training forward's logprobs over the completion tokens (:mod:`twinkle_strategy.rl.mismatch`).

Rollouts from vLLM (``use_vllm=True``), TRL's continuous batching, tool calls and images keep TRL's path and carry
no record. With ``use_vllm=True`` and ``vllm_mode="colocate"``, each rank's engine gets the weights through
``strategy.export_weights`` (:mod:`.grpo_vllm`); ``vllm_mode="server"`` is refused.
"""

from __future__ import annotations

import contextlib

import torch

from twinkle_strategy.compat.trl_internals import grpo_parent, replace_logged_metric
from twinkle_strategy.errors import ParallelConfigError, StrategyConfigError
from twinkle_strategy.integrations.transformers.aux_loss import GlobalAuxLossWindow
from twinkle_strategy.integrations.transformers.grpo_vllm import install_vllm_sync, refuse_vllm_server
from twinkle_strategy.integrations.transformers.trainer import StrategyTrainerMixin
from twinkle_strategy.rl.mismatch import LogprobMismatch, logprob_mismatch
from twinkle_strategy.rl.record import NOT_RECORDED, ROUTED_EXPERTS, pad_records

REPLAY_MODES = ("auto", "r3", "r2", "off")
# Where a batch carries the rollout engine's per-token logprobs [batch, completion]: TRL's own key (vLLM rollouts),
# then the generic one.
ROLLOUT_LOGPROB_KEYS = ("sampling_per_token_logps", "rollout_logprobs")


class StrategyGRPOTrainerMixin(StrategyTrainerMixin):
    """Placed before TRL's ``GRPOTrainer``: generation on every rank, routing replay (R3/R2) of its rollouts."""

    class_prefix = "Strategy"  # with_strategy(GRPOTrainer) is StrategyGRPOTrainer

    def __init__(self, *args, routing_replay: str = "auto", **kwargs) -> None:
        """``routing_replay``: ``"r3"`` replays the routing of the policy's own generation, ``"r2"`` the old policy
        logprob forward's, ``"off"`` none; ``"auto"`` is ``"r3"`` for a model whose routing can be replayed, else
        ``"off"``. An explicit mode on a model that cannot replay raises the reason (the family, the router)."""
        if routing_replay not in REPLAY_MODES:
            raise StrategyConfigError("routing_replay",
                                      f"routing_replay is one of {REPLAY_MODES}, not {routing_replay!r}")
        self._batch_record: torch.Tensor | None = None  # the record of the sequences being scored, [B, S, layers, k]
        self._record_old_policy = False  # R2: the next policy forward of the scored batch records
        self._training_logps: list[torch.Tensor] | None = None  # set while a loss forward's logprobs are kept
        self._rollout_mismatches: list[LogprobMismatch] = []  # the training steps' since the last log line
        refuse_vllm_server(kwargs.get("args", args[2] if len(args) > 2 else None))
        super().__init__(*args, **kwargs)
        install_vllm_sync(self)
        if self.global_aux_loss is not None:  # TRL's logged aux_loss is each rank's own term: the global one instead
            self.aux_loss_window = GlobalAuxLossWindow(self.strategy.device)
        routing = self.strategy.routing
        served = routing is not None and routing.refusal is None
        if routing_replay == "auto":
            routing_replay = "r3" if served else "off"
        elif routing_replay != "off" and not served:
            self.strategy._routing_hooks()  # raises the reason: the same model, so on every rank
        self.routing_replay = routing_replay

    def _trl(self, step: str):
        return grpo_parent(self, StrategyGRPOTrainerMixin, step)  # TRL's own step (an internal, checked)

    # -- generation: on every rank, with the record of what it routed (R3)
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching or images is not None or multimodal_fields:
            return self._trl("_generate_single_turn")(prompt_ids, images, multimodal_fields, num_generations,
                                                      has_tool_images)
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)  # a processor's, or itself
        input_ids = pad(prompts, padding_value=tokenizer.pad_token_id, padding_side="left",
                        pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        attention_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of).to(device)
        record_rollout = self.routing_replay == "r3" and not self.tools  # a tool loop rewrites the completions
        with (unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                          generation_kwargs=self.generation_kwargs,
                                          gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs)
              as model, torch.no_grad()):
            out = self.strategy.generate(model, input_ids=input_ids, attention_mask=attention_mask,
                                         generation_config=self.generation_config, return_routing=record_rollout)
        sequences, record = out if record_rollout else (out, None)
        completions = sequences[:, input_ids.shape[1]:]
        # Everything after the first end-of-sequence token is dropped, as TRL does.
        is_eos = torch.isin(completions, torch.tensor(self.eos_token_ids, device=completions.device))
        lengths = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1) + 1, completions.shape[1]).tolist()
        completion_ids = [row[:n].tolist() for row, n in zip(completions.cpu(), lengths, strict=True)]
        if record is not None:
            prompt_length = input_ids.shape[1]
            self._batch_record = self._padded_record(
                [record[i, prompt_length - len(p):prompt_length] for i, p in enumerate(prompt_ids)],
                [record[i, prompt_length:prompt_length + n] for i, n in enumerate(lengths)])
        return completion_ids, None

    def _padded_record(self, prompt_parts: list[torch.Tensor], completion_parts: list[torch.Tensor]) -> torch.Tensor:
        """The record aligned with TRL's ``cat([prompt_ids, completion_ids])``: prompts padded on the left and
        completions on the right (to ``pad_to_multiple_of``), -1 on the padding."""
        def length(parts):
            longest = max(part.shape[0] for part in parts)
            multiple = self.pad_to_multiple_of
            return longest if not multiple else -(-longest // multiple) * multiple

        return torch.cat([pad_records(prompt_parts, length=length(prompt_parts), padding_side="left"),
                          pad_records(completion_parts, length=length(completion_parts), padding_side="right")], dim=1)

    # -- scoring: the old policy's and the reference's logprobs replay (R3) or record (R2) the routing
    def _generate_and_score_completions(self, inputs):
        self._batch_record = None
        self._record_old_policy = self.routing_replay == "r2" and self.model.training
        try:
            output = self._trl("_generate_and_score_completions")(inputs)
            if self._batch_record is not None:
                output[ROUTED_EXPERTS] = self._batch_record.to(output["prompt_ids"].device)
        finally:
            self._batch_record, self._record_old_policy = None, False
        return output

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs):
        result = self._replayed_logps(model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs)
        if self._training_logps is not None:  # the loss forward: its logprobs are compared with the rollout's
            self._training_logps.append(result[0].detach())
        return result

    def _replayed_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs):
        """TRL's logprob forward of the policy, replaying (R3) or recording (R2) the batch's routing."""
        if (model is not self.model or (self._batch_record is None and not self._record_old_policy)
                or self._scores_the_reference()):
            return self._trl("_get_per_token_logps_and_entropies")(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)
        if any(value is not None for value in kwargs.values() if isinstance(value, torch.Tensor | list)):
            # (image inputs are cut per chunk by TRL; replay serves text models)
            return self._trl("_get_per_token_logps_and_entropies")(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)
        recording, self._record_old_policy = self._record_old_policy, False
        batch_size = batch_size or input_ids.shape[0]
        results, records = [], []
        # TRL forwards the batch in chunks of batch_size rows: each chunk replays (or records) its own rows.
        for start in range(0, input_ids.shape[0], batch_size):
            rows = slice(start, start + batch_size)
            if recording:
                context = self.strategy.routing_record()
            else:
                context = self.strategy.routing_replay(self._batch_record[rows], input_ids=input_ids[rows])
            with context as recorder, self.strategy.routing.uncounted():
                results.append(self._trl("_get_per_token_logps_and_entropies")(
                    model, input_ids[rows], attention_mask[rows], logits_to_keep, None, **kwargs))
            if recording:
                record = recorder.routed_experts(like=input_ids[rows])
                records.append(record.masked_fill(~attention_mask[rows].bool()[..., None, None], NOT_RECORDED))
        if recording:
            self._batch_record = torch.cat(records)
        logps, entropies, aux = zip(*results, strict=True)
        return (torch.cat(logps), None if entropies[0] is None else torch.cat(entropies),
                None if aux[0] is None else torch.stack(aux).mean())

    def _scores_the_reference(self) -> bool:
        """Whether TRL is scoring the reference with the policy's own model: a LoRA run's base (its adapter disabled)
        or its ``"ref"`` adapter. The reference is another policy: it routes freely, as in plain TRL."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        model = self.accelerator.unwrap_model(self.model)
        if getattr(model, "active_adapter", None) == "ref":
            return True
        layer = next((m for m in model.modules() if isinstance(m, BaseTunerLayer)), None)
        return layer is not None and layer.disable_adapters

    # -- the update forwards replay the batch's record
    def replay_of_inputs(self, inputs: dict):
        if ROUTED_EXPERTS not in inputs:
            return inputs, contextlib.nullcontext()
        inputs = dict(inputs)
        record = inputs.pop(ROUTED_EXPERTS)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        return inputs, self.strategy.routing_replay(record, input_ids=input_ids)

    batches_are_model_inputs = False  # prompts: the model's inputs exist once _prepare_inputs has generated

    def _prepare_inputs(self, generation_batch):
        inputs = self._trl("_prepare_inputs")(generation_batch)
        if self.model.training:
            # The token count and the expert load of the log lines see prompts and completions without padding.
            inputs = {**inputs, "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)}
            self.step_metrics.observe(inputs)
            self.step_core.count_tokens_of(inputs)  # padding stays out of the expert load
        return inputs

    # -- mismatch telemetry: the rollout engine's logprobs against the training forward's
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        key = next((key for key in ROLLOUT_LOGPROB_KEYS if inputs.get(key) is not None), None)
        if key is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._training_logps = []
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            kept, self._training_logps = self._training_logps, None
        if len(kept) == 1 and self.model.training:  # (collective: the same key on every rank, same generation path)
            mismatch = logprob_mismatch(kept[0], inputs[key], mask=inputs["completion_mask"])
            if mismatch is not None:
                self._rollout_mismatches.append(mismatch)
        return loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._rollout_mismatches:  # a training line: the steps since the last one
            logs = {**logs, **rollout_mismatch_logs(self._rollout_mismatches)}
            self._rollout_mismatches = []
        if "loss" in logs and self.aux_loss_window is not None:  # (collective: every rank writes the line)
            aux = self.aux_loss_window.take()
            if aux is not None:  # what TRL's line averages into aux_loss: the steps' global-batch loss
                replace_logged_metric(self, "aux_loss", aux)
        super().log(logs, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        # GRPO's inputs are prompts until _prepare_inputs generates: observed there, not here.
        if self.sequence_parallel:
            raise ParallelConfigError(f"sequence_parallel_size={self.strategy.dims.sp_size}: GRPO's batches are "
                                      "generated on each rank and not split along the sequence; train GRPO with "
                                      "sequence_parallel_size=1")
        return super(StrategyTrainerMixin, self).training_step(model, inputs, num_items_in_batch, *args, **kwargs)


def rollout_mismatch_logs(mismatches: list[LogprobMismatch]) -> dict[str, float]:
    """A log line's figures from its steps' mismatches, weighted by their tokens."""
    tokens = sum(m.tokens for m in mismatches)
    return {"rollout/logprob_abs_diff": sum(m.mean_abs * m.tokens for m in mismatches) / tokens,
            "rollout/kl_k3": sum(m.kl_k3 * m.tokens for m in mismatches) / tokens}
