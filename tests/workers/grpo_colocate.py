"""TRL's GRPOTrainer(use_vllm=True, vllm_mode="colocate") under with_strategy: tests/vllm_engine/test_grpo_colocate.py.

Every rank runs in the vllm env's python (vLLM's CPU build) and holds its own colocated engine (TRL starts it, with
vLLM's external launcher inside this job's gloo group). 1 node x 2 ranks, ep=2, fp32, LoRA on attention and
experts, 2 GRPO steps on a tiny Qwen3-MoE; TRL syncs the engine before generating at steps 0 and 1, and the worker
syncs once more after step 2. After each sync, every rank scores fixed token sequences twice: the engine's prompt
logprobs and the trainer's own forward (the adapter active: what the merged export holds). It also counts the calls
of TRL's own sync path (VLLMGeneration._iter_named_params, the per-parameter gather behind its bare load_weights).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

SEQUENCES = 4  # fixed sequences scored after each sync, of LENGTH tokens
LENGTH = 12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm import SamplingParams

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy
    from twinkle_strategy.sources.demo import demo_conversations

    trl_gathers = []
    own_iter = VLLMGeneration._iter_named_params

    def counted(self):
        trl_gathers.append(1)
        return own_iter(self)

    VLLMGeneration._iter_named_params = counted  # TRL's own sync path: must stay unused

    strategy = NativeFSDPStrategy(ep_size=2, memory_efficient_init=True, device_type="cpu", mixed_precision="no")
    model = strategy.from_pretrained(a.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    generator = torch.Generator().manual_seed(5)
    fixed = torch.randint(4, model.config.vocab_size, (SEQUENCES, LENGTH), generator=generator)
    scored = []

    class Scored(with_strategy(GRPOTrainer)):
        def score(self, when: str):
            """The engine's logprob of each fixed token against the trainer's (every rank: the forward is
            collective)."""
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
            outputs = self.vllm_generation.llm.generate([{"prompt_token_ids": row.tolist()} for row in fixed],
                                                        sampling_params=params, use_tqdm=False)
            engine = torch.tensor([[p[int(t)].logprob for p, t in zip(o.prompt_logprobs[1:], row[1:], strict=True)]
                                   for o, row in zip(outputs, fixed, strict=True)])
            training = self.model.training
            self.model.eval()
            with torch.no_grad():
                logits = self.model(input_ids=fixed).logits.float()
            self.model.train(training)
            ours = logits[:, :-1].log_softmax(-1).gather(-1, fixed[:, 1:, None])[..., 0]
            scored.append({"when": when, "step": self.state.global_step,
                           "max_diff": (engine - ours).abs().max().item(), "engine": engine.tolist(),
                           "reports": len(self.weight_sync_reports),
                           "buckets": self.weight_sync_reports[-1].buckets if self.weight_sync_reports else 0})

    sync_of = {}

    class Trainer(Scored):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sync = self.vllm_generation.sync_weights  # the strategy's, installed by with_strategy

            def sync_and_score():
                report = sync()
                self.score(f"sync at step {self.state.global_step}")
                return report
            self.vllm_generation.sync_weights = sync_of["sync"] = sync_and_score

    rows = [r["messages"] for r in demo_conversations()][:32]
    args = GRPOConfig(output_dir=a.out, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, temperature=1.0, learning_rate=5e-2, max_grad_norm=1.0, beta=0.0,
                      logging_steps=1, save_strategy="no", use_cpu=True, report_to=[], seed=0, bf16=False,
                      disable_tqdm=True, shuffle_dataset=False, use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=64, vllm_importance_sampling_correction=False)
    torch.manual_seed(0)
    trainer = Trainer(model=model, args=args, reward_funcs=lambda completions, **_: [float(len(str(c))) for c in
                                                                                    completions],
                      processing_class=tokenizer, train_dataset=Dataset.from_list([{"prompt": [m[0]]} for m in rows]),
                      peft_config=LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "o_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                      strategy=strategy)
    engine_dtype = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    trainer.train()
    sync_of["sync"]()  # after the last step: the engine holds step 2's weights too
    return {"scored": scored, "trl_gathers": len(trl_gathers), "engine_dtype": engine_dtype,
            "steps": trainer.state.global_step, "world": strategy.world_size}


if __name__ == "__main__":
    worker_common.run(main)
