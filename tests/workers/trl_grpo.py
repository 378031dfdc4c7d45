"""TRL's GRPOTrainer and DPOTrainer through NativeFSDPStrategy on the demo MoE (tests/multiproc/test_grpo.py).

``--mode strategy`` (2 nodes x 2, ep=2, fp32), runs in one launch:

* ``lora``: ``with_strategy(GRPOTrainer)``, LoRA on attention and experts, a rule reward, beta > 0 (the reference
  is the model with its adapter disabled), 3 steps, R3 from the policy's own sampled generation (the default),
  a checkpoint after step 1. Each rank writes the completions it generated (``rollouts-rank{r}.json``).
* ``resume``: the same run resumed from step 1's checkpoint, fed the same completions: steps 2-3. With
  ``--resume-from DIR`` (another launch, e.g. 1 node x 4 with ``--ep 4``): ``DIR``'s checkpoint and completions.
* ``bf16``: full parameters, the model loaded in bf16 with ``mixed_precision="bf16"``, fed the ``lora`` run's
  completions, 2 steps (``--mode plain``: the same in one process).
* ``forced``: full parameters, the rollout record of each batch rotated on purpose (every recorded expert id + 1):
  hooks on every router count, in the update forwards, the experts used by the tokens the record covers against
  the record's counts.
* ``r2``: LoRA, ``routing_replay="r2"``, ``num_iterations=2``: the old policy's forward records, the updates replay.
  Its batches also carry the old policy's logprobs as ``rollout_logprobs`` (standing in for a rollout engine's):
  the mixin logs their mismatch with each update forward's.
* ``dpo``: ``with_strategy(DPOTrainer)``, LoRA, 2 steps.

``--mode plain`` (one process, plain TRL trainers): ``lora`` fed the completions the strategy's ranks generated
(``--rollouts``; sampling on 4 ranks cannot be matched by one), the whole global batch per step, and ``dpo``.
"""

import argparse
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

RANKS, MICRO, GENERATIONS, STEPS = 4, 2, 4, 3  # each step: 2 prompts x 4 completions over the 4 ranks
# The MoE load-balancing loss is on in every GRPO run (the demo model's own coefficient is 0.001; larger, so that it
# weighs in the loss and the gradient): TRL's plain GRPOTrainer on one process adds it over its whole batch, the
# global batch; with_strategy(GRPOTrainer) silences TRL's per-rank term and adds the global-batch one instead.
AUX_COEF = 0.1
# bf16 (full parameters): Adam's first step moves every weight by about the learning rate whatever the gradient's
# size, so bf16 rounding of a near-zero gradient moves a weight the other way. At 5e-2 (weights of about 0.02) step 2
# then routed otherwise: its aux loss differed from one process by 2.4% and its gradient norm by 13 u; at 1e-3, 0.3%.
BF16_LR = 1e-3
LORA_TARGETS = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def prompts(count: int) -> list[dict]:
    from twinkle_strategy.sources.demo import demo_conversations

    rows = [r["messages"] for r in demo_conversations() if r["messages"][0]["content"].startswith("What is ")]
    unique = {m[0]["content"]: m for m in rows}  # one group per prompt in a step
    return [{"prompt": [m[0]], "answer": m[1]["content"].split()[-1].rstrip(".")} for m in unique.values()][:count]


def reward(completions, answer, **_) -> list[float]:
    """1 for the right number in the answer, and a shaping term on the length (a random model varies there)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a in t.split()) - abs(len(t) - 12) / 12 for t, a in zip(texts, answer, strict=True)]


def grpo_config(out: str, *, plain: bool, **overrides):
    from trl import GRPOConfig

    ranks = 1 if plain else RANKS
    base = dict(output_dir=out, max_steps=STEPS, per_device_train_batch_size=MICRO * RANKS // ranks,
                num_generations=GENERATIONS, max_completion_length=8, temperature=1.0, learning_rate=5e-2,
                max_grad_norm=1.0, beta=0.04, logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], seed=0,
                bf16=False, disable_tqdm=True, router_aux_loss_coef=AUX_COEF, shuffle_dataset=False)
    return GRPOConfig(**{**base, **overrides})


def logged(trainer, keys=("loss", "reward", "grad_norm", "routing_agreement_min", "routing_agreement_mean",
                          "rollout/logprob_abs_diff", "rollout/kl_k3", "aux_loss")) -> dict:
    lines = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": [h["step"] for h in lines], **{k: [h.get(k) for h in lines] for k in keys}}


class Rollouts:
    """Completions by prompt, in the order they were generated: written by the strategy's ranks, fed to a run."""

    def __init__(self, files: list[str], *, from_step: int = 0, records: str | None = None) -> None:
        self.queue = collections.defaultdict(list)
        # R3: the rollout records one rank kept by step (``records``, a rollouts-*-records-rank*.pt), replayed as if
        # this run had generated the completions; without, a fed run has no record and routes by its router.
        self.records = torch.load(records) if records else {}
        rows = [row for path in sorted(files) for row in json.load(open(path)) if row[0] >= from_step]
        for *_, prompt, completion in sorted(rows, key=lambda r: (r[0], r[1], r[2])):  # step, rank, row
            self.queue[tuple(prompt)].append(completion)

    def take(self, prompt_ids) -> list[list[int]]:
        return [self.queue[tuple(p)].pop(0) for p in prompt_ids]


def grpo_class(base, *, feed: Rollouts | None = None, keep: list | None = None, kept_records: dict | None = None,
               rotate: bool = False, count: dict | None = None, rollout_logprobs: bool = False):
    """``base`` (a GRPO trainer class), fed completions (and R3 records) from ``feed``, keeping what it generated in
    ``keep`` and its rollout records by step in ``kept_records``,
    rotating each rollout record (``rotate``) and counting per MoE layer the experts the update forwards use on
    recorded tokens against the record's (``count``), giving each batch the old policy's logprobs as
    ``rollout_logprobs`` (``rollout_logprobs``)."""

    class TestGRPOTrainer(base):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            step = self.state.global_step
            if feed is not None:
                self._batch_record = feed.records.get(step)
                return feed.take(prompt_ids), None
            completions, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
            if keep is not None:
                keep.extend([step, worker_common.rank(), i, p, c] for i, (p, c) in
                            enumerate(zip(prompt_ids, completions, strict=True)))
                if kept_records is not None and self._batch_record is not None:
                    kept_records[step] = self._batch_record.clone()
            if rotate and self._batch_record is not None:
                record = self._batch_record
                self._batch_record = torch.where(record >= 0, (record + 1) % self.strategy.routing.num_experts, record)
            return completions, logprobs

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if rollout_logprobs:
                output["rollout_logprobs"] = output["old_per_token_logps"]
            return output

        def replay_of_inputs(self, inputs):
            if count is not None:
                count["record"] = inputs.get("routed_experts")
            return super().replay_of_inputs(inputs)

    return TestGRPOTrainer


def count_routing(model, count: dict):
    """Forward hooks on every MoE router: in grad-enabled forwards, add per layer the bincount of the experts the
    router's output dispatches (after replay) and of the record, on the tokens the record covers."""
    from twinkle_strategy.rl.replay import routing_hooks

    hooks = routing_hooks(model)
    count.update(used=torch.zeros(hooks.num_layers, hooks.num_experts),
                 recorded=torch.zeros(hooks.num_layers, hooks.num_experts))

    def hook(index):
        def on_router(_module, _args, output):
            record = count.get("record")
            if not torch.is_grad_enabled() or record is None:
                return
            ids = output[2]
            flat = record.reshape(-1, hooks.num_layers, hooks.top_k)[:, index].to(ids.device)
            covered = (flat >= 0).all(dim=-1)
            count["used"][index] += torch.bincount(ids[covered].flatten(), minlength=hooks.num_experts).float()
            count["recorded"][index] += torch.bincount(flat[covered].flatten(), minlength=hooks.num_experts).float()
        return on_router

    for index, layer in enumerate(hooks.layers):
        layer.router.register_forward_hook(hook(index))


def run_grpo(a, name: str, *, lora: bool, replay: str = "auto", resume: str | None = None, rotate: bool = False,
             feed: Rollouts | None = None, dtype=torch.float32, rollout_logprobs: bool = False, **overrides) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    plain = a.mode == "plain"
    out = os.path.join(a.out, name)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    extra, keep, kept_records, count = {}, [], {}, {} if rotate else None
    if plain:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
        base = GRPOTrainer
    else:
        strategy = NativeFSDPStrategy(ep_size=a.ep, memory_efficient_init=True, device_type="cpu",
                                      mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
        model = strategy.from_pretrained(a.model, dtype=dtype)
        base, extra = with_strategy(GRPOTrainer), {"strategy": strategy, "routing_replay": replay}
    trainer_class = grpo_class(base, feed=feed, keep=None if plain else keep,
                               kept_records=None if plain else kept_records, rotate=rotate, count=count,
                               rollout_logprobs=rollout_logprobs)
    args = grpo_config(out, plain=plain, **overrides)
    torch.manual_seed(0)  # the same fresh adapter in every run
    lora_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **LORA_TARGETS) if lora else None
    trainer = trainer_class(model=model, args=args, reward_funcs=reward, processing_class=tokenizer,
                            train_dataset=Dataset.from_list(prompts(64)), peft_config=lora_config, **extra)
    if count is not None:
        count_routing(trainer.model, count)
    trainer.train(resume_from_checkpoint=resume)
    result = logged(trainer)
    if not plain:
        with open(os.path.join(a.out, f"rollouts-{name}-rank{worker_common.rank()}.json"), "w") as f:
            json.dump(keep, f)
        torch.save(kept_records, os.path.join(a.out, f"rollouts-{name}-records-rank{worker_common.rank()}.pt"))
        result["replay"] = trainer.routing_replay
    if count is not None:
        result["used"], result["recorded"] = count["used"].tolist(), count["recorded"].tolist()
    return {name: result}


def run_dpo(a) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    plain = a.mode == "plain"
    rows = [{"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": f"It is {p['answer']}."}],
             "rejected": [{"role": "assistant", "content": "It is blue."}]} for p in prompts(32)]
    args = DPOConfig(output_dir=os.path.join(a.out, "dpo"), max_steps=2, per_device_train_batch_size=8 if plain else 2,
                     learning_rate=5e-2, max_grad_norm=1.0, logging_steps=1, save_strategy="no", use_cpu=True,
                     report_to=[], seed=0, bf16=False, disable_tqdm=True, dataset_num_proc=None,
                     train_sampling_strategy="sequential")
    if plain:
        model, trainer_class, extra = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32), DPOTrainer, {}
    else:
        strategy = NativeFSDPStrategy(ep_size=2, memory_efficient_init=True, mixed_precision="no", device_type="cpu")
        model = strategy.from_pretrained(a.model, dtype=torch.float32)
        trainer_class, extra = with_strategy(DPOTrainer), {"strategy": strategy}
    torch.manual_seed(0)
    trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=AutoTokenizer.from_pretrained(a.model),
                            peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **LORA_TARGETS), **extra)
    trainer.train()
    return {"dpo": logged(trainer, keys=("loss", "grad_norm", "rewards/margins"))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["strategy", "plain"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", default="lora,resume,bf16,forced,r2,dpo")
    p.add_argument("--rollouts", default=None, help="plain: the directory of the strategy's rollouts-lora-*.json")
    p.add_argument("--ep", type=int, default=2, help="strategy: ep_size of the GRPO runs")
    p.add_argument("--resume-from", default=None,
                   help="strategy, resume: the --out of the launch whose lora run saved checkpoint-1 (default: --out)")
    a = p.parse_args()
    runs = a.runs.split(",")
    result = {}
    if a.mode == "plain":
        if "lora" in runs:
            feed = Rollouts(glob.glob(os.path.join(a.rollouts, "rollouts-lora-rank*.json")))
            result.update(run_grpo(a, "lora", lora=True, feed=feed))
        if "bf16" in runs:
            feed = Rollouts(glob.glob(os.path.join(a.rollouts, "rollouts-lora-rank*.json")))
            result.update(run_grpo(a, "bf16", lora=False, feed=feed, dtype=torch.bfloat16, beta=0.0, max_steps=2,
                                   learning_rate=BF16_LR))
        if "dpo" in runs:
            result.update(run_dpo(a))
        return result
    if "lora" in runs:
        result.update(run_grpo(a, "lora", lora=True, save_strategy="steps", save_steps=1))
    if "resume" in runs:
        # Each rank its own completions (ranks holding completions of one prompt must not take each other's). The
        # same world size (4) on another layout: GRPO's sampler gives rank r the same rows, so rank r's file fits.
        source = a.resume_from or a.out
        rank = worker_common.rank()
        feed = Rollouts([os.path.join(source, f"rollouts-lora-rank{rank}.json")], from_step=1,
                        records=os.path.join(source, f"rollouts-lora-records-rank{rank}.pt"))
        result.update(run_grpo(a, "resume", lora=True, feed=feed, output_dir=os.path.join(a.out, "lora"),
                               resume=os.path.join(source, "lora", "checkpoint-1")))
    if "bf16" in runs:
        feed = Rollouts([os.path.join(a.out, f"rollouts-lora-rank{worker_common.rank()}.json")])
        result.update(run_grpo(a, "bf16", lora=False, feed=feed, dtype=torch.bfloat16, beta=0.0, max_steps=2,
                                   learning_rate=BF16_LR))
    if "forced" in runs:
        result.update(run_grpo(a, "forced", lora=False, rotate=True, beta=0.0, max_steps=2))
    if "r2" in runs:
        result.update(run_grpo(a, "r2", lora=True, replay="r2", num_iterations=2, max_steps=2, rollout_logprobs=True))
    if "dpo" in runs:
        result.update(run_dpo(a))
    return result


if __name__ == "__main__":
    worker_common.run(main)
