"""Routing records and routing replay in one process (ep=1, plain transformers models): the inner loop.

The multi-process checks (EP dispatch of replayed ids, equality with these one-process references,
generation under EP) are tests/multiproc/test_rl.py.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from twinkle_strategy.errors import ModelStructureError, ParallelConfigError
from twinkle_strategy.moe.load import ExpertLoad
from twinkle_strategy.moe.recompute import apply_activation_checkpointing
from twinkle_strategy.rl import NOT_RECORDED, ROUTED_EXPERTS, pack_records, pad_records, routing_hooks
from twinkle_strategy.rl.routers import RULES
from twinkle_strategy.sequence import refuse_generation, split_batch
from twinkle_strategy.testing.tiny_models import build_tiny_model

SERVED = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _ids(model, rows=2, seq=12, seed=0):
    return torch.randint(0, model.config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, hooks=None, record=None):
    """(logits, loss, {name: grad}) of one forward and backward; the backward runs after the replay context."""
    model.zero_grad(set_to_none=True)
    if record is None:
        out = model(input_ids=ids, labels=ids)
    else:
        with hooks.replaying(record, input_ids=ids):
            out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _record_of(model, hooks, ids):
    with torch.no_grad(), hooks.recording() as recorder:
        model(input_ids=ids)
    return recorder.routed_experts(like=ids)


def _other_record(record, num_experts, seed=1):
    """A record that differs from ``record`` everywhere: distinct ids per token, shifted away from the chosen."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, num_experts, record.shape[:-1] + (1,), generator=g)
    other = (base + torch.arange(record.shape[-1])) % num_experts
    clash = (other.unsqueeze(-1) == record.unsqueeze(-2)).any(-1).all(-1, keepdim=True)  # same set: shift more
    return torch.where(clash, (other + 1) % num_experts, other)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("family", SERVED)
def test_replaying_the_models_own_record_changes_nothing(family):
    model = build_tiny_model(family)
    hooks = routing_hooks(model)
    ids = _ids(model)
    record = _record_of(model, hooks, ids)
    assert record.shape == (*ids.shape, hooks.num_layers, hooks.top_k) and record.dtype == torch.long
    logits, loss, grads = _run(model, ids)
    r_logits, r_loss, r_grads = _run(model, ids, hooks, record)
    # The same experts, the family's own weights: the same numbers (the rule reproduces the router's weights).
    assert float((logits - r_logits).abs().max()) <= 1e-6 and abs(float(loss - r_loss)) <= 1e-6
    assert _max_diff(grads, r_grads) <= 1e-6
    assert hooks.take_agreement(reduce=False) == [1.0] * hooks.num_layers


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_forced_record_is_dispatched_and_the_router_learns(family):
    model = build_tiny_model(family)
    hooks = routing_hooks(model)
    load = ExpertLoad(model)
    ids = _ids(model)
    own = _record_of(model, hooks, ids)
    forced = _other_record(own, hooks.num_experts)
    load.take_global()
    logits, _, grads = _run(model, ids, hooks, forced)
    # Every layer's experts got exactly the recorded tokens.
    flat = forced.reshape(-1, hooks.num_layers, hooks.top_k)
    expected = torch.stack([torch.bincount(flat[:, layer].reshape(-1), minlength=load.num_experts)
                            for layer in range(hooks.num_layers)]).float()
    assert torch.equal(load.take_global(), expected)
    own_logits = _run(model, ids)[0]
    assert float((logits - own_logits).abs().max()) > 1e-3  # other experts: other outputs
    routers = [name for name in grads if name.endswith(".gate.weight")]
    assert len(routers) == hooks.num_layers and all(float(grads[n].abs().sum()) > 0 for n in routers)
    # The first layer's own choice is the unforced one, which the record avoids everywhere: agreement 0; later
    # layers see other hidden states, so their own choice moved (and may meet the record by chance).
    shares = hooks.take_agreement(reduce=False)
    assert shares[0] == 0.0 and max(shares) < 0.5


def test_the_recomputation_of_activation_checkpointing_replays_the_record():
    """The backward runs after the replay context: the recomputed routers must still take the record."""
    model = build_tiny_model("qwen3_moe")
    hooks = routing_hooks(model)
    ids = _ids(model)
    forced = _other_record(_record_of(model, hooks, ids), hooks.num_experts)
    logits, loss, grads = _run(model, ids, hooks, forced)
    apply_activation_checkpointing(list(model.model.layers))
    c_logits, c_loss, c_grads = _run(model, ids, hooks, forced)
    assert torch.equal(logits, c_logits) and torch.equal(loss, c_loss)
    assert _max_diff(grads, c_grads) <= 1e-6


def test_unrecorded_tokens_route_freely_and_recording_follows_the_replay():
    model = build_tiny_model("mixtral")
    hooks = routing_hooks(model)
    ids = _ids(model, rows=1)
    own = _record_of(model, hooks, ids)
    forced = _other_record(own, hooks.num_experts)
    forced[:, :4] = NOT_RECORDED  # padding, or tokens the engine did not route
    with torch.no_grad(), hooks.replaying(forced, input_ids=ids), hooks.recording() as recorder:
        model(input_ids=ids)
    used = recorder.routed_experts(like=ids)
    assert torch.equal(used[:, :4], own[:, :4]) and torch.equal(used[:, 4:], forced[:, 4:])
    shares = hooks.take_agreement(reduce=False)
    assert shares == [0.0] * hooks.num_layers  # the 4 free tokens are not compared


def test_records_pad_pack_and_split_with_their_tokens():
    a, b = torch.arange(3 * 2 * 2).view(3, 2, 2), torch.arange(5 * 2 * 2).view(5, 2, 2) + 100
    right = pad_records([a, b])
    assert right.shape == (2, 5, 2, 2) and torch.equal(right[0, :3], a) and (right[0, 3:] == NOT_RECORDED).all()
    left = pad_records([a, b], length=6, padding_side="left")
    assert torch.equal(left[0, 3:], a) and (left[0, :3] == NOT_RECORDED).all() and torch.equal(left[1, 1:], b)
    assert torch.equal(pack_records([a, b])[0], torch.cat([a, b]))
    ids = torch.arange(8).view(1, 8)
    record = pack_records([a, b])
    chunks = [split_batch({"input_ids": ids, "labels": ids, ROUTED_EXPERTS: record}, rank=r, size=3) for r in range(3)]
    # 8 tokens padded to 9: each chunk's record is its tokens' rows, the padding is not recorded.
    assert [c[ROUTED_EXPERTS].shape[1] for c in chunks] == [3, 3, 3]
    assert torch.equal(torch.cat([c[ROUTED_EXPERTS] for c in chunks], 1)[:, :8], record)
    assert (chunks[2][ROUTED_EXPERTS][:, 2] == NOT_RECORDED).all()


def test_a_record_that_does_not_fit_is_refused_naming_the_shapes():
    model = build_tiny_model("qwen3_moe")
    hooks = routing_hooks(model)
    ids = _ids(model)
    record = _record_of(model, hooks, ids)
    with pytest.raises(ValueError, match=r"routed_experts has shape \[2, 11, 2, 2\] but input_ids \[2, 12\] .* "
                                         r"needs \[2, 12, 2, 2\]"):
        with hooks.replaying(record[:, 1:], input_ids=ids):
            pass
    with pytest.raises(ValueError, match="expert ids from 0 to 8, outside 0..7"):
        with hooks.replaying(record.clamp(max=8) + (record == 7).long(), input_ids=ids):
            pass
    with pytest.raises(ValueError, match="must be an integer tensor"):
        with hooks.replaying(record.float(), input_ids=ids):
            pass


@pytest.mark.parametrize("family, router", [("llama4", "Llama4Router"), ("deepseek_v4", "DeepseekV4HashRouter"),
                                            ("dbrx", "")])
def test_a_family_whose_router_cannot_take_forced_ids_is_refused_by_name(family, router):
    model = build_tiny_model(family)
    hooks = routing_hooks(model)
    with pytest.raises(ModelStructureError, match=f"routing replay does not serve .*'{family}.*{router}"):
        with hooks.recording():
            pass


def test_each_rules_router_classes_share_one_forward():
    """A rule covers router classes whose forward is the same code (transformers copies it across models): if one
    copy changes in a new transformers, its class must be checked again before it is replayed."""
    classes = {}
    for module in ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "flex_olmo", "qwen3_omni_moe", "qwen3_5_moe",
                   "qwen3_vl_moe", "mixtral", "minimax", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm4_moe_lite",
                   "glm4v_moe", "dots1", "nemotron_h", "kimi_linear", "solar_open", "exaone_moe", "mimo_v2_flash",
                   "glm_moe_dsa", "gpt_oss"):
        mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        classes.update({name: cls for name, cls in vars(mod).items() if inspect.isclass(cls)})
    for rule in RULES:
        missing = [name for name in rule.classes if name not in classes]
        assert not missing, f"{rule.name}: router classes gone from transformers: {missing}"
        # Two bodies: Qwen3.5's (always renormalises) and Mixtral's (float32 weights) differ from Qwen3's in ways
        # the rule reads from the router (norm_topk_prob absent, the router's own weights' dtype).
        bodies = {inspect.getsource(classes[name].forward) for name in rule.classes}
        assert len(bodies) <= {"softmax, top-k renormalised": 3}.get(rule.name, 1), (rule.name, len(bodies))


def test_generation_is_refused_under_sequence_parallelism():
    model = build_tiny_model("qwen3_moe")
    refuse_generation(model, 2)
    with pytest.raises(ParallelConfigError, match=r"^generate does not run under sequence parallelism "
                                                  r"\(sequence_parallel_size=2\)"):
        model.generate(input_ids=_ids(model), max_new_tokens=2)


def test_generate_records_what_it_routed():
    model = build_tiny_model("deepseek_v3")
    hooks = routing_hooks(model)
    ids = _ids(model, rows=2, seq=5)
    with torch.no_grad(), hooks.recording() as recorder:
        sequences = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
    record = recorder.generated(sequences)
    assert record.shape == (2, 9, hooks.num_layers, hooks.top_k) and (record[:, -1] == NOT_RECORDED).all()
    # fp32: the KV-cache decode routed every fed token as a full forward over the sequences does.
    assert torch.equal(record[:, :-1], _record_of(model, hooks, sequences)[:, :-1])


def test_a_router_fsdp_wrapped_on_its_own_keeps_its_rule():
    """FSDP2 gives a module it shards on its own (a float32 router under bf16) a subclass, FSDP<name>."""
    from twinkle_strategy.rl.routers import rule_for

    router = build_tiny_model("deepseek_v3").model.layers[1].mlp.gate
    router.__class__ = type(f"FSDP{type(router).__name__}", (type(router),), {})
    assert rule_for(router) is not None and rule_for(router).name.startswith("sigmoid")


def test_the_batch_key_replays_and_the_global_aux_loss_counts_the_replayed_experts():
    """What twinkle's Trainer and the HF/TRL mixin do with a batch's routed_experts (one process, no launch)."""
    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.errors import RoutingRecordError
    from twinkle_strategy.moe.balance import GlobalBatchAuxLoss

    model = build_tiny_model("qwen3_moe")
    strategy = NativeFSDPStrategy()
    strategy.routing = routing_hooks(model)
    aux = GlobalBatchAuxLoss.replacing_model_term(model, coef=0.01)
    ids = _ids(model)
    forced = _other_record(_record_of(model, strategy.routing, ids), strategy.routing.num_experts)
    batch = {"input_ids": ids, "labels": ids, ROUTED_EXPERTS: forced}
    stats = aux.prepass(model, [batch], replay_of=strategy.replay_of_batch)
    assert torch.equal(stats.counts, torch.bincount(forced.reshape(-1), minlength=8).float())
    inputs, replay = strategy.replay_of_batch(batch)
    assert ROUTED_EXPERTS not in inputs and ROUTED_EXPERTS in batch  # the caller's batch is left as it was
    with replay as replayed:
        out = model(**inputs, output_router_logits=True)
    _, router = aux.share(out, None, None, replayed.used)
    assert torch.equal(router.counts, stats.counts)
    assert strategy.take_routing_agreement()[0] == 0.0
    assert strategy.replay_of_batch({"input_ids": ids})[0] == {"input_ids": ids}  # no record: nothing to replay
    with pytest.raises(RoutingRecordError, match=r"routing replay failed on rank\(s\) \[0\]: rank 0: routed_experts "
                                                 r"has shape \[2, 12, 2, 1\]"):
        strategy.replay_of_batch({**batch, ROUTED_EXPERTS: forced[..., :1]})
