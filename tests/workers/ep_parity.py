"""EP + FSDP2 versus a single-process run of the same checkpoint.

For every (ep_size, family) case: gathered weights right after wrapping equal
the checkpoint bit for bit; each rank's local experts are exactly its own
experts; logits equal the single-process model; three AdamW steps with EP-aware
clipping give the same losses and weights as the single-process reference.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.shards.plan import fsdp_rows  # noqa: E402

STEPS = 3
LR = 1e-3
MAX_NORM = 0.5
SEQ = 16
PER_RANK = 2


def batch(world: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (world * PER_RANK, SEQ), generator=g)


def reference_run(path: str, ids: torch.Tensor):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss))
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return checkpoint, logits, losses, norms, final


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    assert a.keys() == b.keys(), f"key mismatch: {sorted(a.keys() ^ b.keys())[:5]}"
    for k in a:
        assert a[k].shape == b[k].shape, f"{k}: {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        d = (a[k].float() - b[k].float()).abs().max().item() if a[k].numel() else 0.0
        if d > worst:
            worst, where = d, k
    return worst, where


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--families", default="qwen3_moe,qwen2_moe,mixtral,deepseek_v3")
    p.add_argument("--ep-sizes", default="2,4")
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    cases = []
    refs = {}
    for ep in [int(x) for x in args.ep_sizes.split(",")]:
        strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", device_type="cpu")
        for family in args.families.split(","):
            path = os.path.join(args.ckpt_root, family)
            model = strategy.from_pretrained(path)
            ids = batch(world, model.config.vocab_size)
            if family not in refs:
                refs[family] = reference_run(path, ids)
            checkpoint, ref_logits, ref_losses, ref_norms, ref_final = refs[family]
            # ep=2: the optimizer exists before wrapping and wrap_model rebinds it;
            # ep=4: it is created on the wrapped model. Both must train identically.
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01) if ep == 2 else None
            model, opt = strategy.wrap_model(model, opt)

            init_diff, init_where = max_diff(strategy.full_state_dict(model), checkpoint)
            # Local expert tensors must hold this rank's own experts, not rank 0's.
            own_experts_ok = True
            for name, param in model.named_parameters():
                if name in strategy.ep_plan.axes:
                    local = param.to_local() if isinstance(param, DTensor) else param
                    cut = strategy.ep_plan.cut(name, checkpoint[name])
                    start, stop = fsdp_rows(cut.shape[0], strategy.dims.ep_fsdp_size,
                                            strategy.dims.ep_fsdp_rank(rank))
                    own_experts_ok &= torch.equal(local, cut[start:stop])

            local_ids = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
            model.train()
            with torch.no_grad():
                logits = model(input_ids=local_ids).logits
            logit_diff = (logits - ref_logits[rank * PER_RANK:(rank + 1) * PER_RANK]).abs().max().item()

            if opt is None:
                opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
            losses, norms = [], []
            for _ in range(STEPS):
                opt.zero_grad()
                loss = model(input_ids=local_ids, labels=local_ids).loss
                loss.backward()
                norms.append(float(strategy.clip_grad_norm_(model, MAX_NORM)))
                opt.step()
                losses.append(float(strategy.reduce_mean(loss)))
            final_diff, final_where = max_diff(strategy.full_state_dict(model), ref_final)
            cases.append(dict(
                family=family, ep=ep, init_diff=init_diff, init_where=init_where, own_experts_ok=own_experts_ok,
                logit_diff=logit_diff,
                loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses, strict=False)), losses=losses,
                ref_losses=ref_losses,
                norm_diff=max(abs(a - b) for a, b in zip(norms, ref_norms, strict=False)), norms=norms,
                ref_norms=ref_norms,
                final_diff=final_diff, final_where=final_where,
            ))
            del model, opt
    return {"cases": cases}


if __name__ == "__main__":
    worker_common.run(main)
