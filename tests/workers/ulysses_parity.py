"""Ulysses sequence parallelism + EP + FSDP2 versus one process on the whole sequences (fp32).

For each family (GQA Qwen3-MoE, MLA DeepSeek-V3) and each batch (right-padded rows; packed rows whose
position ids restart at each example and that carry no attention mask), with activation checkpointing:
the logits of every real token, the global per-token loss and the gradient norm equal one process.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.fsdp import find_decoder_layers  # noqa: E402
from twinkle_strategy.moe.recompute import apply_activation_checkpointing  # noqa: E402

ROWS = 2  # the global batch; every data-parallel group takes its share of the rows


def padded_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (ROWS, 22), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # the second row is 15 tokens, padded on the right
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_batch(vocab: int) -> dict:
    """Rows of several examples of very different lengths, position ids restarting at each, no mask."""
    g = torch.Generator().manual_seed(8)
    lengths = [[3, 13, 5], [9, 2, 10]]
    ids = torch.randint(0, vocab, (ROWS, 21), generator=g)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    labels = ids.masked_fill(positions == 0, -100)  # no example predicts the next example's first token
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def reference(path: str, batch: dict):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    # use_cache=False as in training: with a cache transformers does not look for packed sequences.
    out = model(**batch, use_cache=False)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    return out.logits.detach(), float(out.loss), float(norm)


def sharded(strategy: NativeFSDPStrategy, path: str, batch: dict):
    model = strategy.from_pretrained(path, attn_implementation="sdpa")
    apply_activation_checkpointing(find_decoder_layers(model))
    model, _ = strategy.wrap_model(model)
    model.train()
    per_group = ROWS // strategy.data_parallel_size
    first = strategy.data_parallel_rank * per_group
    rows = {k: v[first:first + per_group] for k, v in batch.items()}
    chunk = strategy.split_sequence(rows)
    # The README's call: the chunk's shift_labels, summed over every rank.
    out = model(**chunk, num_items_in_batch=strategy.global_loss_tokens(chunk))
    # FSDP averages gradients over ranks; the loss is this rank's share of the global per-token mean.
    (out.loss * strategy.world_size).backward()
    norm = strategy.clip_grad_norm_(model, 1e9)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    return out.logits.detach(), chunk, first, float(loss), float(norm)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--families", default="qwen3_moe,deepseek_v3")
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--sp", type=int, required=True)
    p.add_argument("--refused", help="checkpoints (comma-separated) sequence parallelism must refuse, by name, on every "
                                     "rank")
    args = p.parse_args()
    strategy = NativeFSDPStrategy(ep_size=args.ep, sequence_parallel_size=args.sp, mixed_precision="no",
                                  device_type="cpu")
    sp_rank = strategy.rank % args.sp
    cases = []
    for family in args.families.split(","):
        path = os.path.join(args.ckpt_root, family)
        for kind, make in (("padded", padded_batch), ("packed", packed_batch)):
            batch = make(128)
            ref_logits, ref_loss, ref_norm = reference(path, batch)
            logits, chunk, first, loss, norm = sharded(strategy, path, batch)
            length, width = batch["input_ids"].shape[1], logits.shape[1]
            begin = sp_rank * width
            stop = min(begin + width, length)  # the last chunk may end in padding added for the split
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))[first:first + len(logits)]
            real = real[:, begin:stop].bool()
            mine = ref_logits[first:first + len(logits), begin:stop]
            logit_diff = (logits[:, :stop - begin] - mine).abs().amax(-1)[real].max().item()
            cases.append(dict(family=family, batch=kind, logit_diff=logit_diff, loss=loss, ref_loss=ref_loss,
                              norm=norm, ref_norm=ref_norm, chunk_tokens=int(chunk["input_ids"].shape[1])))
    refusals = {}
    for path in filter(None, (args.refused or "").split(",")):
        try:
            strategy.from_pretrained(path)
            refusals[os.path.basename(path)] = None
        except Exception as exc:  # noqa: BLE001 - the test reads which error, and its text
            refusals[os.path.basename(path)] = f"{type(exc).__name__}: {exc}"
    return {"cases": cases, "sp": args.sp, "ep": args.ep, "refusals": refusals}


if __name__ == "__main__":
    worker_common.run(main)
