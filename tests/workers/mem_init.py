"""memory_efficient_init against the checkpoint and against the plain (every rank loads) path."""

import argparse
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from alloc_tracker import AllocationTracker  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.loading import model_class_for  # noqa: E402
from twinkle_strategy.shards.plan import fsdp_rows, needs_of  # noqa: E402

SEQ, PER_RANK = 16, 2

# Weight files this process opens while recording (Python's audit hooks see every open(), os.open too).
OPENED_WEIGHT_FILES: list[str] = []
RECORDING = [False]


def _record_opens(event, args):
    if RECORDING[0] and event == "open" and isinstance(args[0], (str, os.PathLike)) \
            and os.fspath(args[0]).endswith(".safetensors"):
        OPENED_WEIGHT_FILES.append(os.fspath(args[0]))


sys.addaudithook(_record_opens)


def reference(path):
    model = model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    return model, state, buffers


def exact_mismatches(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    for k in set(got) & set(want):
        if got[k].shape != want[k].shape or got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]):
            bad.append(k)
    return sorted(bad)


def local_batch(vocab, world, rank):
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, vocab, (world * PER_RANK, SEQ), generator=g)
    return ids, ids[rank * PER_RANK:(rank + 1) * PER_RANK]


def own_experts_ok(strategy, model, state, rank):
    ok = True
    for name, param in model.named_parameters():
        if strategy.ep_plan is not None and name in strategy.ep_plan.axes:
            local = param.to_local() if isinstance(param, DTensor) else param
            cut = strategy.ep_plan.cut(name, state[name])
            start, stop = fsdp_rows(cut.shape[0], strategy.dims.ep_fsdp_size, strategy.dims.ep_fsdp_rank(rank))
            ok &= torch.equal(local, cut[start:stop])
    return ok


def base_cases(args, world, rank):
    cases = []
    for ep in [int(x) for x in args.ep_sizes.split(",")]:
        mem = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", memory_efficient_init=True,
                                 init_bucket_mb=args.bucket_bytes / 2**20)
        plain = NativeFSDPStrategy(ep_size=ep, mixed_precision="no")
        for family in args.families.split(","):
            path = os.path.join(args.ckpt_root, family)
            _, state, buffers = reference(path)
            tracker = AllocationTracker()
            OPENED_WEIGHT_FILES.clear()
            RECORDING[0] = True
            with tracker:
                model = mem.from_pretrained(path)
                model, _ = mem.wrap_model(model)
            RECORDING[0] = False
            report = mem.init_report
            # Allocations shaped like a whole parameter (before or after the EP cut) of
            # which this rank holds less than all: FSDP's padded shard has
            # ceil(rows / mesh size) rows, so a 1-row tensor is "full" on every rank.
            sharded_full = set()
            for n, p in model.named_parameters():
                padded_rows = -(-p.shape[0] // p.device_mesh.size())
                if padded_rows < p.shape[0] or p.shape != state[n].shape:
                    sharded_full |= {(tuple(p.shape), p.dtype), (tuple(state[n].shape), state[n].dtype)}
            sharded_full -= {(tuple(b.shape), b.dtype) for b in model.buffers()}  # buffers arrive whole
            # FSDP allocates every local shard with ceil(rows / mesh size) rows: that shape is this rank's own.
            sharded_full -= {((-(-p.shape[0] // p.device_mesh.size()),) + tuple(p.shape[1:]), p.dtype)
                             for p in model.parameters()}
            full_shaped = [a for a in tracker.allocations if (a[0], a[1]) in sharded_full]
            # FSDP allocates ceil(rows / mesh size) rows per rank (padding included).
            largest_local = max(-(-p.shape[0] // p.device_mesh.size()) * (p.numel() // max(p.shape[0], 1))
                                * p.element_size() for p in model.parameters())
            largest_buffer = max(b.numel() * b.element_size() for b in model.buffers())
            # One index of dim 0 (an expert of a fused expert tensor): the least a source reads at a time.
            largest_row = max(p.numel() // max(p.shape[0], 1) * p.element_size() for p in state.values())
            # The plan (tensor names and regions, pickled) the source gathers from its node: metadata, not weights.
            plan_bytes = len(pickle.dumps([need for need, _ in needs_of(model, mem.ep_plan)]))

            got = mem.full_state_dict(model)
            got_buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
            ids, mine = local_batch(model.config.get_text_config().vocab_size, world, rank)
            with torch.no_grad():
                logits = model(input_ids=mine).logits
            plain_model, _ = plain.wrap_model(plain.from_pretrained(path))
            with torch.no_grad():
                plain_logits = plain_model(input_ids=mine).logits
            cases.append(dict(
                family=family, ep=ep, state_mismatches=exact_mismatches(got, state),
                buffer_mismatches=exact_mismatches(got_buffers, buffers),
                own_experts_ok=own_experts_ok(mem, model, state, rank),
                tied=bool(model.config.tie_word_embeddings),
                tied_ok=model.get_output_embeddings().weight is model.get_input_embeddings().weight,
                logit_diff_vs_plain=(logits - plain_logits).abs().max().item(),
                report=vars(report), full_shaped_allocations=[str(a) for a in full_shaped],
                largest_allocation=tracker.largest, largest_local=largest_local, largest_buffer=largest_buffer,
                largest_row=largest_row, plan_bytes=plan_bytes,
                node_plan_bytes=plan_bytes * mem.topology.local_world_size,
                config_bytes=len(pickle.dumps(model.config)),
                model_bytes=sum(t.numel() * t.element_size() for t in state.values()),
                opened_weight_files=sorted(set(OPENED_WEIGHT_FILES)),
                weight_files=sorted(f for f in os.listdir(path) if f.endswith(".safetensors")),
            ))
            del model, plain_model
    return cases


def lora_cases(args, world, rank):
    from peft import LoraConfig, PeftModel, get_peft_model

    path = os.path.join(args.ckpt_root, "qwen3_moe")
    cases = []
    for mode in ("fresh", "loaded"):
        cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                         init_lora_weights=(mode == "fresh"))
        # Single-process reference with the same seed.
        ref_base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        torch.manual_seed(7)
        ref = get_peft_model(ref_base, cfg)
        adapter_dir = os.path.join(os.environ["TWINKLE_TEST_OUT"], f"adapter_rank{rank}")
        if mode == "loaded":
            ref.save_pretrained(adapter_dir)
        ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
        ids, mine = local_batch(ref.config.vocab_size, world, rank)
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits[rank * PER_RANK:(rank + 1) * PER_RANK]

        strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                      init_bucket_mb=args.bucket_bytes / 2**20)
        base = strategy.from_pretrained(path)
        if mode == "fresh":
            torch.manual_seed(7)
            model = get_peft_model(base, cfg)
        else:
            model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
        model, _ = strategy.wrap_model(model)
        got = strategy.full_state_dict(model)
        with torch.no_grad():
            logits = model(input_ids=mine).logits
        lora_keys = [k for k in ref_state if "lora_" in k]
        cases.append(dict(
            mode=mode, lora_keys=len(lora_keys),
            expert_lora_keys=len([k for k in lora_keys if "experts" in k]),
            mismatches=exact_mismatches(got, ref_state),
            logit_diff=(logits - ref_logits).abs().max().item(),
            report=vars(strategy.init_report),
        ))
    return cases


def in_memory_cases(args):
    """The source's model in host memory: loaded whole (stream_checkpoint=False), or partly replaced by the user."""
    from torch import nn

    path = os.path.join(args.ckpt_root, "mixtral_sharded")
    _, state, _ = reference(path)
    cases = {}
    whole = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, stream_checkpoint=False,
                               init_bucket_mb=args.bucket_bytes / 2**20)
    model, _ = whole.wrap_model(whole.from_pretrained(path))
    cases["whole"] = dict(mismatches=exact_mismatches(whole.full_state_dict(model), state),
                          report=vars(whole.init_report))
    # A new head, built by the user between from_pretrained and wrap_model: it lives in the source's memory
    # (a real tensor, kept by reference) while everything else streams from the checkpoint.
    mixed = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                               init_bucket_mb=args.bucket_bytes / 2**20)
    model = mixed.from_pretrained(path)
    torch.manual_seed(11)
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    torch.manual_seed(11)
    new_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).weight.detach().clone()
    model, _ = mixed.wrap_model(model)
    got = mixed.full_state_dict(model)
    cases["new_head"] = dict(mismatches=exact_mismatches(got, {**state, "lm_head.weight": new_head}),
                             report=vars(mixed.init_report))
    return cases


def scatter_case(args):
    path = os.path.join(args.ckpt_root, "qwen3_moe")
    states = {}
    for kind in ("p2p", "scatter"):
        strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                      init_bucket_mb=args.bucket_bytes / 2**20, init_transport=kind)
        model, _ = strategy.wrap_model(strategy.from_pretrained(path))
        states[kind] = strategy.full_state_dict(model)
        report = strategy.init_report
    return dict(mismatches_vs_p2p=exact_mismatches(states["scatter"], states["p2p"]),
                bytes_received=report.bytes_received, kept=report.shard_bytes + report.buffer_bytes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--families", default="qwen3_moe,qwen2_moe,mixtral,deepseek_v3")
    p.add_argument("--ep-sizes", default="2,4")
    p.add_argument("--bucket-bytes", type=int, default=4096)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--also-scatter", action="store_true")
    p.add_argument("--also-in-memory", action="store_true")
    p.add_argument("--bad-ckpt", default=None)
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    result = {"cases": base_cases(args, world, rank)}
    if args.lora:
        result["lora"] = lora_cases(args, world, rank)
    if args.also_scatter:
        result["scatter"] = scatter_case(args)
    if args.also_in_memory:
        result["in_memory"] = in_memory_cases(args)
    worker_common.write_result(result)
    if args.bad_ckpt:
        strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True)
        strategy.wrap_model(strategy.from_pretrained(args.bad_ckpt))  # must raise on every rank
    return result


if __name__ == "__main__":
    worker_common.run(main, failure_waits_for_every_rank_s=60)
