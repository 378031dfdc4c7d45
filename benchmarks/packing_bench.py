"""Non-padding tokens per second: padded batches vs data.packing vs data.padding_free, in one run.

    python benchmarks/packing_bench.py --lengths benchmarks/results/packing_lengths.json
    python benchmarks/packing_bench.py --from-seed-tasks seed_tasks.jsonl   # re-derive the lengths first

Lengths: every instance of Stanford Alpaca's ``seed_tasks.jsonl`` (github.com/tatsu-lab/stanford_alpaca,
commit 761dc5b; the 175 human-written tasks Alpaca's data was generated from), each rendered as the
ChatML conversation user = instruction + input, assistant = output, and tokenized with a byte-level BPE
(vocab 4096) trained on the file's own text (``demo_model.build_tokenizer``): real relative lengths, not a
production tokenizer's absolute ones. Stored in ``results/packing_lengths.json``.

Every layout trains the same examples (forward + backward of the embedded tiny Qwen3-MoE, fp32, one
process, sdpa) in the same micro-batches of ``--batch`` examples, in the same seeded order: padded rows
(attention_mask), the same examples flattened (padding_free), and packs of up to ``--max-length`` tokens
(``--batch`` packs per micro-batch would change the budget, so packing gets one pack per micro-batch
whose budget equals the padded micro-batch's mean token count, rounded up to ``--max-length``).
The figure is real tokens / seconds; the ratio to padded is what carries over to other machines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twinkle_strategy.testing.tiny_models import build_tiny_model  # noqa: E402
from twinkle_strategy.train.data import DataCollatorForSFT  # noqa: E402
from twinkle_strategy.train.packing import DataCollatorForPacking, pack_examples, prepare_for_packed_batches  # noqa: E402


def seed_task_lengths(path: str) -> list[int]:
    from twinkle_strategy.train.demo_model import build_tokenizer

    rows = [json.loads(line) for line in open(path)]
    texts = [(r["instruction"] + "\n" + i["input"], i["output"]) for r in rows for i in r["instances"]]
    tokenizer = build_tokenizer([t for pair in texts for t in pair], vocab_size=4096)
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                              tokenize=True)["input_ids"]) for q, a in texts]


def examples_of(lengths: list[int], vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in lengths:
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": ids})
    return out


def timed(model, batches: list[dict]) -> float:
    start = time.perf_counter()
    for batch in batches:
        model(**batch).loss.backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default=os.path.join(os.path.dirname(__file__), "results", "packing_lengths.json"))
    p.add_argument("--from-seed-tasks", help="derive the lengths from this seed_tasks.jsonl and store them")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    if args.from_seed_tasks:
        with open(args.lengths, "w") as f:
            json.dump({"source": "github.com/tatsu-lab/stanford_alpaca@761dc5b seed_tasks.jsonl",
                       "lengths": seed_task_lengths(args.from_seed_tasks)}, f)
    lengths = [min(n, args.max_length) for n in json.load(open(args.lengths))["lengths"]]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_tiny_model("qwen3_moe", hidden_size=64, intermediate_size=64)
    prepare_for_packed_batches(model)
    examples = examples_of(lengths, model.config.vocab_size)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(1)).tolist()
    groups = [[examples[i] for i in order[s:s + args.batch]] for s in range(0, len(order), args.batch)]
    budget = min(args.max_length * args.batch, -(-sum(lengths) // len(groups)))
    packs = pack_examples([examples[i] for i in order], max(budget, max(lengths)))
    layouts = {
        "padded": [DataCollatorForSFT(0)(g) for g in groups],
        "padding_free": [DataCollatorForPacking()(g) for g in groups],
        "packing": [DataCollatorForPacking()([pack]) for pack in packs],
    }
    real = sum(lengths)
    results = {}
    for name, batches in layouts.items():
        positions = sum(b["input_ids"].numel() for b in batches)
        seconds = min(timed(model, batches) for _ in range(args.repeat))
        results[name] = {"tokens_per_second": real / seconds, "padding_fraction": 1 - real / positions,
                         "micro_batches": len(batches), "seconds": seconds}
    base = results["padded"]["tokens_per_second"]
    lines = [f"examples {len(lengths)}, real tokens {real}, lengths {min(lengths)}..{max(lengths)} "
             f"(median {sorted(lengths)[len(lengths) // 2]})", "",
             "| layout | micro-batches | padding | non-padding tokens/s | vs padded |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['micro_batches']} | {100 * r['padding_fraction']:.1f}% | "
                     f"{r['tokens_per_second']:.0f} | {r['tokens_per_second'] / base:.2f}x |")
    print("\n".join(lines))
    out = os.path.join(os.path.dirname(__file__), "results", "packing_bench")
    with open(out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
