"""Generation and routing replay under EP + FSDP2, against one process (tests/multiproc/test_rl.py).

--generate: greedy and sampled ``generate`` (KV cache) of Qwen3-MoE and DeepSeek-V3 with prompts of different
lengths and numbers per rank, stop tokens hit at different steps on different ranks, one rank without a
prompt; fp32 full and LoRA (attention and experts) against the same model in one process; bf16 run and compared;
greedy fp32 of gpt-oss, Mixtral and Qwen3-MoE with a sliding window of 4 tokens (shorter than most prompts).
--replay (ep=2, activation checkpointing): R3 with the trainer's own record equals no replay (padded and
packed rows); a forced record is dispatched (expert loads) and the router's gradient equals one process
replaying it; a record that does not fit on one rank is refused on every rank.
--sp: R3 under sequence parallelism (sp=2) with a record of the whole rows cut by split_sequence.
--measure: bf16 rollout (generate with KV cache, recorded) against the training forward over the same
sequences, without and with R3: routing agreement and logprob gap.
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
from twinkle_strategy.errors import RoutingRecordError  # noqa: E402
from twinkle_strategy.fsdp import find_decoder_layers  # noqa: E402
from twinkle_strategy.moe.load import ExpertLoad  # noqa: E402
from twinkle_strategy.moe.recompute import apply_activation_checkpointing  # noqa: E402
from twinkle_strategy.rl import NOT_RECORDED, ROUTED_EXPERTS, routing_hooks  # noqa: E402

FAMILIES = ("qwen3_moe", "deepseek_v3")
# Sliding-window attention, window 4 (tests/multiproc/test_rl.py saves them): gpt-oss alternates sliding and full
# layers, Mixtral and Qwen3-MoE (use_sliding_window) slide in every layer. Most prompts are longer than the window and
# generation runs past it, so the KV cache's sliding layers drop keys during prefill and decoding.
SLIDING_WINDOW_CHECKPOINTS = ("gpt_oss_sw4", "mixtral_sw4", "qwen3_moe_sw4")
PROMPT_LENGTHS = {0: [3, 6], 1: [5], 2: [4, 2, 7], 3: []}  # rank 3 has no prompt
PAD = 0
ROWS, SEQ = 2, 12
ATTENTION = {"deepseek_v3": ["q_b_proj", "o_proj"]}


def prompts(rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's prompts, left-padded (as generation pads), and their attention mask."""
    lengths = PROMPT_LENGTHS[rank % 4]
    g = torch.Generator().manual_seed(100 + rank)
    width = max(lengths, default=1)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return ids, mask


def with_lora(model, family: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)  # the same adapter on every rank and in the reference; lora_B random so it counts
    config = LoraConfig(r=2, lora_alpha=4, target_modules=ATTENTION.get(family, ["q_proj", "o_proj"]),
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        init_lora_weights=False)
    return get_peft_model(model, config)


def load(strategy, path, family, *, dtype=torch.float32, lora=False):
    model = strategy.from_pretrained(path, dtype=dtype)
    return strategy.wrap_model(with_lora(model, family) if lora else model)[0]


def plain(path, family, *, dtype=torch.float32, lora=False):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return with_lora(model, family) if lora else model


def generation_cases(strategy, path, family, rank, *, dtype, lora, sampled):
    """This rank's generations on the wrapped model and on the same model in one process."""
    reference = plain(path, family, dtype=dtype, lora=lora).eval()
    model = load(strategy, path, family, dtype=dtype, lora=lora).eval()
    ids, mask = prompts(rank, reference.config.vocab_size)
    max_new = 5 + rank  # ranks end at different steps
    common = dict(max_new_tokens=max_new, pad_token_id=PAD, do_sample=sampled, top_k=0)
    eos = None
    if ids.shape[0]:
        # A stop token the first prompt reaches at step 1 + rank % 3: ranks stop at different steps.
        with torch.no_grad():
            free = reference.generate(input_ids=ids, attention_mask=mask, eos_token_id=None, **common)
        eos = int(free[0, ids.shape[1] + 1 + rank % 3])
    kwargs = dict(common, eos_token_id=eos)
    expected = None
    if ids.shape[0]:
        torch.manual_seed(11 + rank)
        with torch.no_grad():
            expected = reference.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.manual_seed(11 + rank)
    with torch.no_grad():
        got, record = strategy.generate(model, input_ids=ids, attention_mask=mask, return_routing=True, **kwargs)
    same = expected is None and got.shape[0] == 0 or expected is not None and torch.equal(got, expected)
    stop_step = None
    if eos is not None:
        hit = (got[0, ids.shape[1]:] == eos).nonzero()
        stop_step = int(hit[0]) if len(hit) else None
    return dict(family=family, dtype=str(dtype), lora=lora, sampled=sampled, prompts=int(ids.shape[0]),
                sliding_window=getattr(reference.config, "sliding_window", None),
                same=bool(same), got=got.tolist(), expected=None if expected is None else expected.tolist(),
                stop_step=stop_step, record_shape=list(record.shape),
                record_tail_unrecorded=bool((record[:, -1] == NOT_RECORDED).all()) if record.shape[0] else True)


def local_grads(model):
    return {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
            for n, p in model.named_parameters() if p.grad is not None}


def step(model, batch, strategy=None, record=None):
    """Logits, loss and local gradients of one forward/backward; the backward runs after the replay context."""
    model.zero_grad(set_to_none=True)
    if record is None:
        out = model(**batch)
    else:
        with strategy.routing_replay(record, input_ids=batch["input_ids"]):
            out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), local_grads(model)


def max_diff(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        return max(max_diff(a[k], b[k]) for k in a)
    return float((a.float() - b.float()).abs().max())


def forced_record(ids: torch.Tensor, layers: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """A record with distinct random experts per token (not the router's choice)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, experts, (*ids.shape, layers, 1), generator=g)
    return (base + torch.arange(top_k)) % experts


def replay_cases(strategy, path, family, rank, world):
    model = load(strategy, path, family)
    apply_activation_checkpointing(find_decoder_layers(model))
    model.train()
    hooks = strategy.routing
    g = torch.Generator().manual_seed(5)
    global_ids = torch.randint(3, model.config.vocab_size, (world * ROWS, SEQ), generator=g)
    ids = global_ids[rank * ROWS:(rank + 1) * ROWS]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on the first row
    cases = {}
    for kind, batch in {
        "padded": dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
        # two examples packed in one row, positions restarting
        "packed": dict(input_ids=ids.reshape(1, -1), labels=ids.reshape(1, -1),
                       position_ids=torch.arange(SEQ).repeat(ROWS).unsqueeze(0)),
    }.items():
        with torch.no_grad(), strategy.routing_record() as recorder:
            model(**{k: v for k, v in batch.items() if k != "labels"})
        own = recorder.routed_experts(like=batch["input_ids"])
        if kind == "padded":
            own[0, :3] = NOT_RECORDED  # padding: not recorded, the router chooses
        logits, loss, grads = step(model, batch)
        r_logits, r_loss, r_grads = step(model, batch, strategy, own)
        cases[kind] = dict(logit_diff=max_diff(logits, r_logits), loss_diff=max_diff(loss, r_loss),
                           grad_diff=max_diff(grads, r_grads), agreement=strategy.take_routing_agreement())

    # A record that is not the router's choice: dispatched as recorded, the router's gradient as in one process.
    load_counter = ExpertLoad(model, ep_size=strategy.ep_size)
    global_forced = forced_record(global_ids, hooks.num_layers, hooks.top_k, hooks.num_experts, seed=9)
    forced = global_forced[rank * ROWS:(rank + 1) * ROWS]
    batch = dict(input_ids=ids, labels=ids)
    step(model, batch, strategy, forced)
    counts = load_counter.take_global()
    expected = torch.stack([torch.bincount(global_forced[:, :, layer].reshape(-1), minlength=hooks.num_experts)
                            for layer in range(hooks.num_layers)]).float()
    routers = {n: p.grad.full_tensor() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}

    reference = plain(path, family)
    ref_hooks = routing_hooks(reference)
    with ref_hooks.replaying(global_forced, input_ids=global_ids):
        reference(input_ids=global_ids, labels=global_ids).loss.backward()
    ref_routers = {n: p.grad for n, p in reference.named_parameters() if n.endswith("mlp.gate.weight")}
    cases["forced"] = dict(load_equal=bool(torch.equal(counts, expected)), load=counts.tolist(),
                           router_grad_diff=max_diff(routers, ref_routers),
                           router_grad_norm=min(float(g.norm()) for g in routers.values()),
                           routers=len(routers), agreement=strategy.take_routing_agreement())

    # Every token on experts 0..top_k-1, all owned by EP rank 0: the other EP rank receives no token and completes.
    starved = torch.arange(hooks.top_k).expand(*ids.shape, hooks.num_layers, hooks.top_k)
    _, starved_loss, _ = step(model, batch, strategy, starved)
    starved_counts = load_counter.take_global()
    cases["starved"] = dict(loss=float(starved_loss), counts_equal=bool(torch.equal(
        starved_counts[:, :hooks.top_k], torch.full((hooks.num_layers, hooks.top_k), float(global_ids.numel()))))
        and float(starved_counts[:, hooks.top_k:].sum()) == 0.0)
    strategy.take_routing_agreement()

    # A record that does not fit its batch on rank 1 only: every rank refuses, naming rank 1 and the shapes.
    bad = forced[:, :-1] if rank == 1 else forced
    try:
        with strategy.routing_replay(bad, input_ids=ids):
            model(input_ids=ids)
        cases["refusal"] = None
    except RoutingRecordError as exc:
        cases["refusal"] = str(exc)
    return cases


def sp_case(path, family, rank, world):
    """R3 at sp=2 (ep=2): the whole rows' record, cut by split_sequence, equals the run without replay."""
    strategy = NativeFSDPStrategy(ep_size=2, sequence_parallel_size=2, mixed_precision="no", device_type="cpu")
    reference = plain(path, family)
    model = load(strategy, path, family)
    apply_activation_checkpointing(find_decoder_layers(model))
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, model.config.vocab_size, (world // 2 * ROWS, SEQ + 1), generator=g)  # 13: padded to 14
    dp = strategy.data_parallel_rank
    ids = ids[dp * ROWS:(dp + 1) * ROWS]
    whole_record = routing_hooks(reference)
    with torch.no_grad(), whole_record.recording() as recorder:
        reference(input_ids=ids)
    chunk = strategy.split_sequence({"input_ids": ids, "labels": ids, ROUTED_EXPERTS: recorder.routed_experts(like=ids)})
    record = chunk.pop(ROUTED_EXPERTS)
    logits, loss, grads = step(model, chunk)
    r_logits, r_loss, r_grads = step(model, chunk, strategy, record)
    generate_refusal = None
    try:
        model.generate(input_ids=ids, max_new_tokens=2)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        generate_refusal = f"{type(exc).__name__}: {exc}"
    return dict(logit_diff=max_diff(logits, r_logits), loss_diff=max_diff(loss, r_loss),
                grad_diff=max_diff(grads, r_grads), agreement=strategy.take_routing_agreement(),
                chunk_tokens=int(record.shape[1]), generate_refusal=generate_refusal)


def token_logprobs(logits: torch.Tensor, sequences: torch.Tensor, start: int) -> torch.Tensor:
    """Log-probabilities of the generated tokens ``sequences[:, start:]`` under ``logits`` of the full forward."""
    logprobs = torch.log_softmax(logits[:, start - 1:-1].float(), dim=-1)
    return logprobs.gather(-1, sequences[:, start:].unsqueeze(-1)).squeeze(-1)


def measure_case(strategy, path, family, rank):
    """bf16: a rollout by generate (KV cache) against the training forward over its sequences."""
    model = load(strategy, path, family, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(50 + rank)
    ids = torch.randint(3, model.config.vocab_size, (8, 8), generator=g)
    mask = torch.ones_like(ids)
    torch.manual_seed(60 + rank)
    with torch.no_grad():
        out, record = strategy.generate(model, input_ids=ids, attention_mask=mask, return_routing=True,
                                        max_new_tokens=40, do_sample=True, top_k=0, pad_token_id=PAD,
                                        eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    sequences = out.sequences
    start = ids.shape[1]
    rollout = torch.stack([torch.log_softmax(step_logits.float(), -1) for step_logits in out.logits], 1)
    rollout = rollout.gather(-1, sequences[:, start:].unsqueeze(-1)).squeeze(-1)
    full_mask = torch.ones_like(sequences)
    fed = record[:, :-1]  # the last token was never fed to the model
    with torch.no_grad(), strategy.routing_record() as own:
        plain_logits = model(input_ids=sequences, attention_mask=full_mask).logits
    own_record = own.routed_experts(like=sequences)[:, :-1]
    same_set = (own_record.sort(-1).values == fed.sort(-1).values).all(-1)  # [batch, tokens, layers]
    with torch.no_grad(), strategy.routing_replay(record, input_ids=sequences), strategy.routing_record() as used:
        r3_logits = model(input_ids=sequences, attention_mask=full_mask).logits
    agreement_under_r3 = strategy.take_routing_agreement()
    result = dict(
        tokens=int(fed.shape[0] * fed.shape[1]),
        disagreement_per_layer=(1 - same_set.float().mean(dim=(0, 1))).tolist(),
        tokens_differing_in_some_layer=float((~same_set).any(-1).float().mean()),
        r3_routing_equal=bool(torch.equal(used.routed_experts(like=sequences)[:, :-1], fed)),
        agreement_under_r3=agreement_under_r3)
    for mode, logits in (("no_replay", plain_logits), ("r3", r3_logits)):
        trainer = token_logprobs(logits, sequences, start)
        result[f"{mode}_logprob_gap"] = float((trainer - rollout).abs().mean())
        result[f"{mode}_kl"] = float((rollout - trainer).mean())  # k1 estimate of KL(rollout || trainer)
    return dict(family=family, **result)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--ep", type=int, required=True)
    p.add_argument("--generate", action="store_true")
    p.add_argument("--replay", action="store_true")
    p.add_argument("--sp", action="store_true")
    p.add_argument("--measure", action="store_true")
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    strategy = NativeFSDPStrategy(ep_size=args.ep, mixed_precision="no", device_type="cpu")
    out = {}
    if args.generate:
        cases = []
        for family in FAMILIES:
            path = os.path.join(args.ckpt_root, family)
            for sampled in (False, True):
                cases.append(generation_cases(strategy, path, family, rank, dtype=torch.float32, lora=False,
                                              sampled=sampled))
            cases.append(generation_cases(strategy, path, family, rank, dtype=torch.bfloat16, lora=False,
                                          sampled=False))
        cases.append(generation_cases(strategy, os.path.join(args.ckpt_root, "qwen3_moe"), "qwen3_moe", rank,
                                      dtype=torch.float32, lora=True, sampled=False))
        for name in SLIDING_WINDOW_CHECKPOINTS:  # greedy fp32: the KV cache of sliding-window layers
            cases.append(generation_cases(strategy, os.path.join(args.ckpt_root, name), name, rank,
                                          dtype=torch.float32, lora=False, sampled=False))
        out["generation"] = cases
    if args.replay:
        out["replay"] = {f: replay_cases(strategy, os.path.join(args.ckpt_root, f), f, rank, world) for f in FAMILIES}
    if args.measure:
        out["measure"] = [measure_case(strategy, os.path.join(args.ckpt_root, f), f, rank) for f in FAMILIES]
    if args.sp:
        out["sp"] = sp_case(os.path.join(args.ckpt_root, "qwen3_moe"), "qwen3_moe", rank, world)
    return out


if __name__ == "__main__":
    worker_common.run(main)
