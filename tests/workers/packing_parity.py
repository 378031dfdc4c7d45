"""Packed training steps versus one process on the same examples unpacked, one example per padded row.

Each rank runs the Trainer's own step (``compute_gradients``: data.packing's packs or padding-free
micro-batches, flattened into one row each, gradient accumulation over ``--accumulation`` micro-batches, activation
checkpointing) with EP + FSDP2, then records: the step's loss, its gradient norm, and the loss of every
example it trained (a no-grad forward of its micro-batches, cut at the position_ids restarts), and with
``--aux-coef`` the global-batch aux loss (in the objective, hence the gradient norm). Rank 0
first computes the same figures in one process, unpacked. ``--lower-level`` adds the README's loop on the
Python API, with a rank that has no token to learn. ``--refuse FAMILY`` instead builds a packing
Trainer for a family whose layers would mix packed examples: each rank records the error it raised.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import worker_common  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.train.arguments import TrainingArguments  # noqa: E402
from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset  # noqa: E402
from twinkle_strategy.train.packing import DataCollatorForPacking  # noqa: E402
from twinkle_strategy.train.trainer import Trainer  # noqa: E402

LORA_SEED = 7
MAX_LENGTH = 48
# Very different lengths (3 to 44 tokens): packs of several examples, one example alone in its pack.
LENGTHS = [44, 3, 17, 9, 30, 5, 12, 26, 7, 40, 4, 21, 11, 6, 33, 14, 8, 19, 25, 10]


def make_examples(vocab: int) -> list[dict[str, list[int]]]:
    """Token ids with a prompt (labels -100) of a third of each example, then a response to learn."""
    g = torch.Generator().manual_seed(2027)
    examples = []
    for n in LENGTHS:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        prompt = max(1, n // 3)
        examples.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return examples


def with_adapter(model, lora: bool):
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(LORA_SEED)  # the same fresh adapter on every rank and in the reference
    # init_lora_weights=False: lora_B is random too, so the adapter changes the logits from the start.
    return get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                            init_lora_weights=False))


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of next-token prediction (0 where the label is -100), shape of ``labels``."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().transpose(1, 2), shifted, ignore_index=-100, reduction="none")


def reference(path: str, dtype, lora: bool, examples: list[dict], aux_coef: float = 0.0) -> dict:
    """One process, one example per padded row (attention_mask), the whole step's examples in one batch; with
    ``aux_coef`` the model's own load-balancing loss over that batch (padding masked) joins the objective."""
    model = with_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lora)
    model.train()
    batch = DataCollatorForSFT(pad_token_id=0)(examples)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=aux_coef > 0)
    losses = token_losses(out.logits, batch["labels"])
    counted = (F.pad(batch["labels"], (0, 1), value=-100)[..., 1:] != -100)
    loss = losses.sum() / counted.sum()
    aux = out.aux_loss if aux_coef > 0 else torch.zeros(())
    (loss + aux_coef * aux).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    per_example = (losses.sum(1) / counted.sum(1)).tolist()
    return {"loss": float(loss), "aux_loss": float(aux), "grad_norm": float(torch.nn.utils.get_total_norm(grads)),
            "examples": per_example}


def example_losses(trainer: Trainer, examples: list[dict]) -> dict[int, float]:
    """This rank's examples of step 0 (index in ``examples``) -> their mean loss, from the packed forward."""
    index = {tuple(e["input_ids"]): i for i, e in enumerate(examples)}
    result = {}
    with torch.no_grad():
        for batch in trainer._micro_batches(0):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            losses = token_losses(trainer.model(**inputs).logits, batch["labels"])[0]
            starts = (batch["position_ids"][0] == 0).nonzero().reshape(-1).tolist() + [batch["input_ids"].numel()]
            for a, b in zip(starts, starts[1:], strict=False):
                counted = (F.pad(batch["labels"][0, a:b], (0, 1), value=-100)[1:] != -100).sum()
                result[index[tuple(batch["input_ids"][0, a:b].tolist())]] = float(losses[a:b].sum() / counted)
    return result


def step_examples(trainer: Trainer) -> list[dict]:
    """The examples of step 0's global batch (packs unpacked), in dataset order."""
    items = [trainer.train_dataset[i] for i in trainer.sampler.rows(0)]
    return [e for item in items for e in getattr(item, "examples", (item,))]


def run_case(args, strategy, *, lora: bool, packing: bool, out: str) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = with_adapter(strategy.from_pretrained(args.ckpt, dtype=dtype), lora)
    examples = make_examples(model.config.vocab_size)
    dataset = SFTDataset(examples, max_length=MAX_LENGTH, packing=packing)
    per_device = 1 if packing else 2
    trainer = Trainer(model=model, strategy=strategy, train_dataset=dataset, data_collator=DataCollatorForPacking(),
                      args=TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=per_device,
                                             gradient_accumulation_steps=args.accumulation, gradient_checkpointing=True,
                                             seed=3, router_aux_loss_coef=args.aux_coef))
    trainer.setup()
    trained = step_examples(trainer)
    ref = reference(args.ckpt, dtype, lora, trained, args.aux_coef) if strategy.rank == 0 else None
    result = trainer.compute_gradients(0)
    grad_norm = float(strategy.clip_grad_norm_(trainer.model, float("inf")))
    order = [examples.index(e) for e in trained]
    mine = example_losses(trainer, examples)
    case = {"lora": lora, "packing": packing, "loss": float(result["loss"]), "aux_loss": float(result["aux_loss"]),
            "grad_norm": grad_norm, "tokens": float(result["tokens"]), "step_tokens": sum(len(e["input_ids"]) for e in trained),
            "example_losses": mine, "rows": [len(b["input_ids"]) for b in trainer._micro_batches(0)],
            "batch_shapes": [list(b["input_ids"].shape) for b in trainer._micro_batches(0)]}
    if ref is not None:
        case["ref"] = {**ref, "examples": dict(zip(order, ref["examples"], strict=True))}
    return case


def lower_level_loop(args, strategy) -> dict:
    """The README's loop on a wrapped model: ``global_loss_tokens`` as ``num_items_in_batch``, with rank 0 starved
    (its one example has only prompt tokens, nothing to learn), the other ranks one example each."""
    model, _ = strategy.wrap_model(strategy.from_pretrained(args.ckpt))
    examples = make_examples(model.config.vocab_size)[:strategy.world_size]
    examples[0] = {"input_ids": examples[0]["input_ids"], "labels": [-100] * len(examples[0]["input_ids"])}
    ref = reference(args.ckpt, torch.float32, False, examples) if strategy.rank == 0 else None
    batch = DataCollatorForSFT(pad_token_id=0)([examples[strategy.rank]])
    count = strategy.global_loss_tokens(batch)
    model.train()
    share = model(**batch, num_items_in_batch=count).loss
    (share * strategy.world_size).backward()
    norm = float(strategy.clip_grad_norm_(model, float("inf")))
    return {"share": float(share), "loss": float(strategy.reduce_sum(share)), "grad_norm": norm, "count": int(count),
            "ref": ref and {"loss": ref["loss"], "grad_norm": ref["grad_norm"],
                            "count": sum(len(e["input_ids"]) - 1 - e["labels"][1:].count(-100) for e in examples)}}


def refuse(args) -> dict:
    strategy = NativeFSDPStrategy(ep_size=1, mixed_precision="no", device_type="cpu")
    model = strategy.from_pretrained(args.ckpt)
    examples = make_examples(model.config.vocab_size)
    trainer = Trainer(model=model, strategy=strategy, train_dataset=SFTDataset(examples, max_length=MAX_LENGTH,
                                                                              packing=True),
                      data_collator=DataCollatorForPacking(), args=TrainingArguments(output_dir=args.out, max_steps=1))
    trainer.setup()
    return {}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--aux-coef", type=float, default=0.0, help="router_aux_loss_coef: the global-batch aux loss")
    p.add_argument("--cases", default="full-packing,lora-packing,lora-padding_free")
    p.add_argument("--out", required=True)
    p.add_argument("--refuse", action="store_true")
    p.add_argument("--lower-level", action="store_true", help="also run the README's lower-level loop")
    args = p.parse_args()
    if args.refuse:
        return refuse(args)
    strategy = NativeFSDPStrategy(ep_size=args.ep, mixed_precision="no", device_type="cpu")
    cases = []
    for name in args.cases.split(","):
        tuner, layout = name.split("-")
        cases.append({"name": name, **run_case(args, strategy, lora=tuner == "lora", packing=layout == "packing",
                                                out=os.path.join(args.out, name))})
    return {"cases": cases, "lower_level": lower_level_loop(args, strategy) if args.lower_level else None}


if __name__ == "__main__":
    worker_common.run(main, failure_waits_for_every_rank_s=60)
