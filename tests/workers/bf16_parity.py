"""bf16 as users run it, against one process loading the same checkpoint with dtype=torch.bfloat16.

Each case (family x mode) loads a checkpoint through the strategy in bf16, with
``mixed_precision='bf16'``, and records, next to the single-process model's:

* every gathered tensor's dtype and bits right after init (fp32-kept ones included);
* the dtype each fp32-kept parameter has while its module computes (a bf16 cast of a
  router changes routing);
* each MoE layer's routing decisions (the top-k experts of every token);
* logits, loss and gradient norm after one backward.

Modes: ``full``/``lora`` with memory_efficient_init (streaming), ``full-plain``/``lora-plain``
without it (every rank loads), ``full-inmemory`` (memory_efficient_init, stream_checkpoint=False:
the source loads the whole model and sends from memory).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from mem_init import exact_mismatches  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.loading import model_class_for  # noqa: E402
from twinkle_strategy.moe.lora_experts import compute_lora_on_activations  # noqa: E402

SEQ, PER_RANK = 16, 2
U = 2.0 ** -8  # bf16 unit roundoff
LORA_SEED = 7
ATTENTION = {"deepseek_v3": ["q_b_proj", "o_proj"], "deepseek_v4": ["q_b_proj", "o_b_proj"]}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def with_adapter(model, family: str, lora: bool):
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(LORA_SEED)  # the same fresh adapter on every rank and in the reference
    # init_lora_weights=False: lora_B is random too, so a wrong adapter slice changes the logits.
    config = LoraConfig(r=2, lora_alpha=4, target_modules=ATTENTION.get(family, ["q_proj", "o_proj"]),
                        target_parameters=EXPERTS, init_lora_weights=False)
    return get_peft_model(model, config)


class Probes:
    """Routing decisions of every experts module, and the dtype of fp32-kept tensors while they compute."""

    def __init__(self, model, kept_names: list[str]):
        self.routing: dict[str, list[torch.Tensor]] = {}
        self.compute_dtypes: dict[str, str] = {}
        self.recording = False
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] == "experts":  # the outermost module at block.experts (PEFT wraps it)
                module.register_forward_pre_hook(self._routing_hook(name))
        for name in kept_names:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner).register_forward_pre_hook(self._dtype_hook(name, attr))

    def _routing_hook(self, name):
        def hook(module, args):
            # experts(hidden_states, top_k_index, top_k_weights): the router's choice (Llama-4's pre-routed
            # experts(routed_in) shows none).
            if self.recording and len(args) >= 2:
                self.routing.setdefault(name, []).append(args[1].detach().sort(dim=-1).values)
        return hook

    def _dtype_hook(self, name, attr):
        def hook(module, args):
            # After FSDP's own pre-forward hook: the tensor the module computes with.
            self.compute_dtypes[name] = str(getattr(module, attr).dtype)
        return hook

    def choices(self) -> list[torch.Tensor]:
        return [torch.cat(calls) for calls in self.routing.values()]


def routed_logits(model, ids, probes):
    """Logits of ``ids``, recording the routing. The reference runs this rank's rows alone too: on the CPU a
    bf16 matmul's rounding depends on the batch shape, so one process on the whole batch would not compute
    the first router's input bit for bit as a rank does."""
    model.train()
    probes.recording = True
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    probes.recording = False
    return logits


def loss_and_norm(model, ids, strategy=None) -> tuple[float, float]:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if strategy is not None:
        return float(strategy.reduce_mean(loss)), float(strategy.clip_grad_norm_(model, float("inf")))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(loss), float(torch.nn.utils.get_total_norm(grads))


def batch(vocab: int, world: int):
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (world * PER_RANK, SEQ), generator=g)


def reference(path: str, family: str, lora: bool, ids, mine):
    model = model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.bfloat16)
    model = with_adapter(model, family, lora)
    # The same compute as the strategy's model: LoRA on the experts' activations (lora_experts' default), which
    # rounds otherwise than PEFT's W + BA in bf16 (tests/unit/test_lora_experts.py compares the two paths).
    compute_lora_on_activations(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # What transformers keeps in fp32 (adapters aside: PEFT keeps LoRA in fp32 by design).
    kept = sorted(k for k, v in state.items() if v.dtype == torch.float32 and "lora_" not in k)
    probes = Probes(model, [k for k in kept if k in dict(model.named_parameters())])
    logits = routed_logits(model, mine, probes)
    loss, norm = loss_and_norm(model, ids)
    return dict(state=state, kept=kept, probes=probes, logits=logits, loss=loss, norm=norm)


def strategy_for(mode: str, ep: int) -> NativeFSDPStrategy:
    # Full parameters: mixed_precision='bf16' as users run it (on a bf16 model it computes in the model's
    # dtypes and reduces gradients in fp32; it must leave fp32-kept modules in fp32). LoRA: 'no', which on a
    # bf16 model computes exactly as one process does (PEFT keeps adapters in fp32; a bf16 policy would cast
    # them for compute, and the first router's input would then differ by design).
    precision = "no" if mode.startswith("lora") else "bf16"
    return NativeFSDPStrategy(ep_size=ep, mixed_precision=precision, timeout_s=300,
                              memory_efficient_init=not mode.endswith("-plain"),
                              stream_checkpoint=not mode.endswith("-inmemory"))


def routed_otherwise(mine: list[torch.Tensor], ref: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per MoE layer, which of this rank's tokens chose another set of experts than in the reference."""
    return [(got != want).any(dim=-1) for got, want in zip(mine, ref, strict=False)]


def run_case(path: str, family: str, mode: str, ep: int, world: int, rank: int) -> dict:
    """One case on this rank: the strategy's model against one process's (see the module docstring)."""
    lora = mode.startswith("lora")
    ids = batch(AutoConfig.from_pretrained(path).get_text_config().vocab_size, world)
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    ref = reference(path, family, lora, ids, mine)
    strategy = strategy_for(mode, ep)
    model = with_adapter(strategy.from_pretrained(path, dtype=torch.bfloat16), family, lora)
    model, _ = strategy.wrap_model(model)
    got = strategy.full_state_dict(model)
    probes = Probes(model, [k for k in ref["kept"] if k in dict(model.named_parameters())])
    logits = routed_logits(model, mine, probes)
    loss, norm = loss_and_norm(model, mine, strategy)
    return dict(
        family=family, mode=mode, ep=ep, kept=ref["kept"],
        state_mismatches=exact_mismatches(got, ref["state"]),
        dtype_mismatches=sorted(k for k in got if k in ref["state"] and got[k].dtype != ref["state"][k].dtype),
        compute_dtypes=probes.compute_dtypes, ref_compute_dtypes=ref["probes"].compute_dtypes,
        moe_layers=len(probes.choices()), ref_moe_layers=len(ref["probes"].choices()),
        loss=loss, ref_loss=ref["loss"], norm=norm, ref_norm=ref["norm"],
        **compared_logits(logits, ref["logits"], routed_otherwise(probes.choices(), ref["probes"].choices())),
    )


def compared_logits(logits, want, otherwise: list[torch.Tensor]) -> dict:
    """Logits are compared where every layer routed the token as one process did; a token a later layer
    routed otherwise (a bf16 near-tie) is counted instead."""
    same = ~torch.stack(otherwise).any(dim=0) if otherwise else torch.ones(PER_RANK * SEQ, dtype=torch.bool)
    diff = (logits.float() - want.float()).abs()
    return dict(routing_differences=[float(t.float().mean()) for t in otherwise], tokens=same.numel(),
                same_routing_tokens=int(same.sum()), logit_diff=diff[same.view(PER_RANK, SEQ)].max().item(),
                logit_diff_all=diff.max().item(), logit_scale=want.float().abs().max().item())


def _gradient_shards(model) -> dict[str, torch.Tensor]:
    """This rank's shard of every gradient, as it is stored (bf16, or fp32 for fp32-kept parameters)."""
    from twinkle_strategy.distributed.dtensor import local_tensor

    return {name: local_tensor(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}


def reduce_dtype_case(path: str, ep: int, world: int, rank: int) -> dict:
    """One bf16 backward with the gradients summed across ranks in fp32 (the default) and in bf16
    (``reduce_dtype='bfloat16'``), on the same model and tokens: this rank's gradient shards and the bound of their
    difference (test_bf16.py's REDUCE_DTYPE docstring).

    Each rank's own contribution is measured too: with fp32 reduction and every other rank's loss scaled by 0, the
    reduced gradient is rank j's contribution divided by the group size, exactly (one non-zero term, a power of
    two). Their absolute sum bounds, element by element, the mean of |gradient| over the ranks a reduction adds up.
    """
    import torch.distributed as dist

    ids = batch(AutoConfig.from_pretrained(path).get_text_config().vocab_size, world)
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    shards, contributions = {}, {}
    for reduce in ("float32", "bfloat16"):
        strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", reduce_dtype=reduce, timeout_s=300)
        model, _ = strategy.wrap_model(strategy.from_pretrained(path, dtype=torch.bfloat16))
        model.train()
        model(input_ids=mine, labels=mine).loss.backward()
        shards[reduce] = _gradient_shards(model)
        if reduce == "float32":
            for j in range(world):
                model.zero_grad()
                (model(input_ids=mine, labels=mine).loss * float(rank == j)).backward()
                for name, g in _gradient_shards(model).items():
                    contributions[name] = contributions.get(name, 0) + g.float().abs()
    fp32, bf16 = shards["float32"], shards["bfloat16"]
    kept = sorted(n for n, g in fp32.items() if g.dtype == torch.float32)  # fp32-kept units reduce in fp32 anyway
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for name, want in fp32.items():
        got = bf16[name]
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        difference = (got.float() - want.float()).abs()
        # In units of u times the ranks' absolute sum (the smallest bf16 subnormal added: 0/0 where all is 0).
        scaled = difference / (U * contributions[name] + 2.0 ** -133)
        worst = max(worst, float(scaled.max())) if scaled.numel() else worst
        diff2 += float(difference.double().pow(2).sum())
        ref2 += float(want.double().pow(2).sum())
    sums = torch.tensor([diff2, ref2], dtype=torch.float64)
    dist.all_reduce(sums)  # every element lives on one rank
    return dict(kept=kept, kept_equal=all(torch.equal(bf16[n], fp32[n]) for n in kept),
                bf16_grads=sum(g.dtype == torch.bfloat16 for g in fp32.values()),
                differ=sum(not torch.equal(bf16[n], fp32[n]) for n in fp32), worst_in_u=worst,
                relative_norm_difference=float(sums[0].sqrt() / sums[1].sqrt()))


def changed_on_sources_case(path: str) -> dict:
    """The sources cast their model to bf16 before wrap_model (the router bias too), the other ranks do not:
    every rank must stop with an error naming the tensor and what transformers chose, not blame the dtype
    the user asked for."""
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="bf16", memory_efficient_init=True,
                                  stream_checkpoint=False, timeout_s=120)
    model = strategy.from_pretrained(path, dtype=torch.bfloat16)
    if strategy.topology.is_source:
        model = model.to(torch.bfloat16)
    try:
        strategy.wrap_model(model)
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        return dict(error_type=type(exc).__name__, error=str(exc))
    return dict(error_type=None, error=None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--cases", required=True, help="family:mode,... (modes: full lora full-plain lora-plain "
                                                  "full-inmemory)")
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--changed-on-sources", default=None, help="a family whose sources change dtypes (see above)")
    p.add_argument("--reduce-dtype", default=None, help="a family whose gradients are reduced in fp32 and in bf16 "
                                                        "(reduce_dtype), then compared")
    p.add_argument("--roundtrip", default="", help="then save and resume in bf16: family[+lora],... "
                                                   "(tests/workers/roundtrip.py)")
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cases = []
    for item in args.cases.split(","):
        family, mode = item.split(":")
        cases.append(run_case(os.path.join(args.ckpt_root, family), family, mode, args.ep, world, rank))
        worker_common.write_result({"cases": cases})
    result = {"cases": cases, "roundtrips": []}
    for item in filter(None, args.roundtrip.split(",")):
        from roundtrip import roundtrip_case

        family, _, lora = item.partition("+")
        result["roundtrips"].append(roundtrip_case(
            os.path.join(args.ckpt_root, family), family, bool(lora), rank, dtype=torch.bfloat16, ep_size=args.ep,
            max_file_bytes=32 * 2**10, with_adapter=lambda model, lora, family: with_adapter(model, family, lora)))
        worker_common.write_result(result)
    if args.reduce_dtype:
        result["reduce_dtype"] = reduce_dtype_case(os.path.join(args.ckpt_root, args.reduce_dtype), args.ep, world,
                                                   rank)
        worker_common.write_result(result)
    if args.changed_on_sources:
        result["changed"] = changed_on_sources_case(os.path.join(args.ckpt_root, args.changed_on_sources))
    return result


if __name__ == "__main__":
    worker_common.run(main)
