"""Global-batch load balancing and EP-aware activation checkpointing, against single-process oracles.

One launch (2 nodes x 2 ranks, ep=2, fp32) checks:

* aux: the Trainer with router_aux_loss_coef and 2 accumulation micro-batches: its loss, aux loss and
  every gradient equal one process on the concatenated global batch (the model's own aux loss), and
  the expert counts behind moe_load_imbalance equal a single-process count of that batch.
* checkpointing: two steps with and without gradient_checkpointing, LoRA on experts and full
  parameters: same losses, grad norms and expert counts, and no more all-to-alls per step.
* bf16_aux: three steps with router_aux_loss_coef in bf16 (mixed_precision='bf16', the model loaded in bf16)
  and in fp32, on the demo (Qwen3-MoE) and on --second-model (another family): the losses each logs.
* refused: last, the same bf16 run with the modeling module's load_balancing_loss_func replaced by another form
  (each layer's loss alone, averaged): the error each rank raised at its first step.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.moe.load import load_imbalance  # noqa: E402
from twinkle_strategy.shards.gather import gather_full_tensor  # noqa: E402
from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset  # noqa: E402
from twinkle_strategy.train.trainer import Trainer, TrainingArguments  # noqa: E402

COEF = 0.05
ALL_TO_ALLS = [0]
_all_to_all_single = dist.all_to_all_single


def counting_all_to_all_single(*args, **kwargs):
    ALL_TO_ALLS[0] += 1
    return _all_to_all_single(*args, **kwargs)


dist.all_to_all_single = counting_all_to_all_single  # counts, then runs the real collective


def make_trainer(args, dataset, collator, tokenizer, *, lora: bool, model_path: str | None = None,
                 dtype: torch.dtype = torch.float32, **train_kwargs) -> Trainer:
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="bf16" if dtype == torch.bfloat16 else "no",
                                  device_type="cpu")
    model = strategy.from_pretrained(model_path or args.model, dtype=dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj",
                                                                    "mlp.experts.down_proj"], init_lora_weights=False))
    train_args = TrainingArguments(**{"output_dir": args.output_dir, "per_device_train_batch_size": 2, "max_steps": 2,
                                      "learning_rate": 1e-3, "seed": 3, **train_kwargs})
    trainer = Trainer(model=model, strategy=strategy, args=train_args, train_dataset=dataset,
                      data_collator=collator, processing_class=tokenizer)
    trainer.setup()
    return trainer


def reference(model_path: str, batch: dict) -> dict:
    """One process, the concatenated global batch, the model's own loss = LM loss + coef x aux loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.output_router_logits = True
    model.router_aux_loss_coef = COEF
    model.train()
    out = model(**batch)
    out.loss.backward()
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    mask = batch["attention_mask"].reshape(-1).float()
    counts = torch.stack([torch.zeros(experts).index_add_(0, logits.topk(top_k, dim=-1).indices.reshape(-1),
                                                          mask.repeat_interleave(top_k))
                          for logits in out.router_logits])
    return {"loss": float(out.loss - COEF * out.aux_loss), "aux": float(out.aux_loss), "counts": counts,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}


def aux_case(args, dataset, collator, tokenizer) -> dict:
    trainer = make_trainer(args, dataset, collator, tokenizer, lora=False, gradient_accumulation_steps=2,
                           router_aux_loss_coef=COEF)
    result = trainer.compute_gradients(0)
    counts = trainer.step_core.take_expert_counts()
    strategy = trainer.strategy
    grads = {n: gather_full_tensor(n, p.grad, strategy.ep_plan)
             for n, p in trainer.model.named_parameters()}
    ref = reference(args.model, collator([dataset[i] for i in trainer.sampler.rows(0)]))  # step 0's global batch
    worst, where = 0.0, None
    for name, grad in ref["grads"].items():
        diff = float((grads[name] - grad).abs().max())
        if diff > worst:
            worst, where = diff, name
    return {"loss": float(result["loss"]), "ref_loss": ref["loss"], "aux": float(result["aux_loss"]), "ref_aux": ref["aux"],
            "grad_diff": worst, "grad_where": where, "grads_compared": len(ref["grads"]),
            "counts": counts.tolist(), "ref_counts": ref["counts"].tolist(),
            "imbalance": load_imbalance(counts), "ref_imbalance": load_imbalance(ref["counts"])}


def checkpointing_case(args, dataset, collator, tokenizer, *, lora: bool, gc: bool) -> dict:
    trainer = make_trainer(args, dataset, collator, tokenizer, lora=lora, gradient_checkpointing=gc)
    steps = []
    for step in range(2):
        before = ALL_TO_ALLS[0]
        result = trainer.training_step(step)
        steps.append({"loss": float(result["loss"]), "grad_norm": float(result["grad_norm"]),
                      "all_to_alls": ALL_TO_ALLS[0] - before,
                      "counts": result["expert_counts"].tolist()})
    return {"steps": steps}


def bf16_aux_case(args, dataset, collator, tokenizer, model_path: str) -> dict:
    """Three steps with the global-batch aux loss, 2 micro-batches each, in bf16 and in fp32 (full parameters)."""
    runs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        trainer = make_trainer(args, dataset, collator, tokenizer, lora=False, model_path=model_path, dtype=dtype,
                               gradient_accumulation_steps=2, router_aux_loss_coef=COEF, max_steps=3)
        steps = [trainer.training_step(step) for step in range(3)]
        runs[name] = {key: [float(s[key]) for s in steps] for key in ("loss", "aux_loss", "grad_norm")}
        runs[name]["model_class"] = type(trainer.balancing.balancing.owner).__name__
    return runs


def refused_case(args, dataset, collator, tokenizer) -> dict:
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from twinkle_strategy.errors import ModelStructureError

    switch = modeling_qwen3_moe.load_balancing_loss_func

    def per_layer_mean(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return sum(switch((layer,), num_experts, top_k, attention_mask) for layer in gate_logits) / len(gate_logits)

    modeling_qwen3_moe.load_balancing_loss_func = per_layer_mean
    try:
        trainer = make_trainer(args, dataset, collator, tokenizer, lora=False, dtype=torch.bfloat16,
                               router_aux_loss_coef=COEF)
        trainer.training_step(0)
    except ModelStructureError as error:
        return {"error": str(error)}
    finally:
        modeling_qwen3_moe.load_balancing_loss_func = switch
    return {"error": None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--second-model", required=True, help="another family's demo checkpoint (bf16_aux)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = SFTDataset.from_jsonl(args.dataset, tokenizer, max_length=48)
    collator = DataCollatorForSFT(tokenizer.pad_token_id)
    results = {"aux": aux_case(args, dataset, collator, tokenizer)}
    for lora in (True, False):
        for gc in (False, True):
            results[f"{'lora' if lora else 'full'}_gc{int(gc)}"] = checkpointing_case(
                args, dataset, collator, tokenizer, lora=lora, gc=gc)
    results["bf16_aux"] = {path: bf16_aux_case(args, dataset, collator, tokenizer, path)
                           for path in (args.model, args.second_model)}
    results["refused"] = refused_case(args, dataset, collator, tokenizer)  # last: its step stops after a forward
    return results


if __name__ == "__main__":
    worker_common.run(main)
