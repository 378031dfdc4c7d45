"""The MoE family matrix: memory_efficient_init + EP + FSDP2 against a single process, one launch for all.

For each served family (optionally with LoRA on its experts): the gathered
weights right after wrapping equal the single-process model's bit for bit,
each rank's local experts are its own, the logits match, and so do the loss
and the gradient norm after one backward. For each refused model, wrap_model
raises on every rank (the error is recorded and the next case runs: a refusal
happens before any collective, so the ranks stay in step).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from bf16_parity import run_case as bf16_case  # noqa: E402
from mem_init import exact_mismatches, local_batch, own_experts_ok  # noqa: E402
from roundtrip import roundtrip_case  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.errors import TwinkleError  # noqa: E402
from twinkle_strategy.loading import model_class_for  # noqa: E402
from twinkle_strategy.testing.families import VISION_LANGUAGE_FAMILIES  # noqa: E402

LORA_SEED = 7
# LoRA on attention and on each family's fused expert tensors (PEFT target_parameters).
LORA_TARGETS = {
    "llama4": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],  # pre-routed experts
    "nemotron_h": ["mixer.experts.up_proj", "mixer.experts.down_proj"],  # non-gated experts
    "longcat_flash": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # gate_up holds zero experts too
    # vision-language checkpoints: the language model's experts
    "qwen3_5_moe_vl": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    "qwen3_vl_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def lora_config(family: str):
    from peft import LoraConfig

    # init_lora_weights=False: lora_B is random too, so a wrong adapter slice changes the logits.
    return LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], target_parameters=LORA_TARGETS[family],
                      init_lora_weights=False)


def with_adapter(model, lora: bool, family: str):
    if not lora:
        return model
    from peft import get_peft_model

    torch.manual_seed(LORA_SEED)  # the same fresh adapter on every rank and in the reference
    return get_peft_model(model, lora_config(family))


def grad_norm(model, strategy=None) -> float:
    if strategy is not None:
        return float(strategy.clip_grad_norm_(model, float("inf")))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


def training_is_random(model, ids) -> bool:
    """Whether two training-mode forwards differ (Phi-MoE's sparsemixer samples its routing)."""
    model.train()
    with torch.no_grad():
        torch.manual_seed(1)
        first = model(input_ids=ids).logits
        torch.manual_seed(2)
        return not torch.equal(first, model(input_ids=ids).logits)


def forward_backward(model, ids, strategy=None, train: bool = True):
    """(logits, loss, gradient norm) of ``model`` on ``ids``."""
    model.train(train)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if strategy is not None:
        loss = strategy.reduce_mean(loss)
    return logits, float(loss), grad_norm(model, strategy)


def count_zero_expert_choices(model) -> list[int]:
    """A counter of the router's choices of zero-computation experts (LongCat-Flash), filled by forwards."""
    count = [0]

    def hook(module, args):
        count[0] += int((args[1] >= module.num_routed_experts).sum())

    for module in model.modules():
        if hasattr(module, "zero_expert_num") and hasattr(module, "num_routed_experts"):
            module.register_forward_pre_hook(hook)
    return count


def load_single_process(path: str):
    """The checkpoint as one process loads it: its own class (image-text-to-text for a vision-language one)."""
    return model_class_for(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)


def served_case(path: str, family: str, lora: bool, world: int, rank: int) -> dict:
    reference = with_adapter(load_single_process(path), lora, family)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    ids, mine = local_batch(reference.config.get_text_config().vocab_size, world, rank)
    # A model whose training-mode forward is random cannot match another process: compare it in eval mode.
    train = not training_is_random(reference, ids)
    zero_expert_choices = count_zero_expert_choices(reference)
    ref_logits, ref_loss, ref_norm = forward_backward(reference, ids, train=train)
    del reference

    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, timeout_s=120)
    model = with_adapter(strategy.from_pretrained(path), lora, family)
    model, _ = strategy.wrap_model(model)
    mismatches = exact_mismatches(strategy.full_state_dict(model), state)
    own = own_experts_ok(strategy, model, state, rank)
    logits, loss, norm = forward_backward(model, mine, strategy, train=train)
    per_rank = ref_logits.shape[0] // world
    case = dict(
        family=family, lora=lora, train_mode=train, state_mismatches=mismatches, own_experts_ok=own,
        expert_tensors=len(strategy.ep_plan.axes), lora_tensors=len([k for k in state if "lora_" in k]),
        logit_diff=(logits - ref_logits[rank * per_rank:(rank + 1) * per_rank]).abs().max().item(),
        loss=loss, ref_loss=ref_loss, norm=norm, ref_norm=ref_norm, zero_expert_choices=zero_expert_choices[0],
        # (fully_shard makes the class FSDP<class>)
        model_class=type(model.get_base_model() if lora else model).__name__.removeprefix("FSDP"),
        vision_tensors=len([k for k in state if ".visual." in k]),
    )
    if lora and family in VISION_LANGUAGE_FAMILIES:
        case["adapter"] = saved_adapter_check(strategy, model, path, ids, ref_logits)
    return case


def saved_adapter_check(strategy, model, path, ids, ref_logits) -> dict:
    """Save the adapter as the trainer does (gathered, full [r*E] expert LoRA) and load it with plain PEFT
    onto the vision-language class in one process: it must give the single-process adapter's logits."""
    from peft import PeftModel

    out = os.path.join(os.environ["TWINKLE_TEST_OUT"], f"adapter-{os.path.basename(path)}")
    state = strategy.full_state_dict(model, rank0_only=True,
                                     keys={n for n, p in model.named_parameters() if p.requires_grad})
    if strategy.rank == 0:
        model.save_pretrained(out, state_dict=state)
    dist.barrier()
    loaded = PeftModel.from_pretrained(load_single_process(path), out)
    loaded.eval()
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    return dict(base_class=type(loaded.get_base_model()).__name__,
                lora_tensors=len([n for n in loaded.state_dict() if "lora_" in n]),
                logit_diff=(logits - ref_logits).abs().max().item())


def with_unknown_experts_forward(model):
    """``model`` whose experts pick their own top-k from router logits: a call EP has no dispatch for."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class SelfRoutingExperts(Qwen3MoeExperts):
        def forward(self, hidden_states, router_logits):
            weights, index = router_logits.softmax(-1).topk(2)
            return super().forward(hidden_states, index, weights)

    for module in model.modules():
        if isinstance(module, Qwen3MoeExperts):
            module.__class__ = SelfRoutingExperts
    return model


def refused_case(path: str, name: str) -> dict:
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True)
    model = strategy.from_pretrained(path)
    if name == "unknown_forward":
        model = with_unknown_experts_forward(model)
    try:
        strategy.wrap_model(model)
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        return dict(name=name, error_type=type(exc).__name__, error=str(exc))
    return dict(name=name, error_type=None, error=None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--families", required=True)
    p.add_argument("--lora", default="", help="families also run with LoRA on attention and experts")
    p.add_argument("--refused", default="", help="checkpoints wrap_model must refuse: name=directory,...")
    p.add_argument("--bf16", default="", help="families also run in bf16 against one process in bf16 "
                                               "(tests/workers/bf16_parity.py's full-parameter case)")
    p.add_argument("--roundtrip", default="",
                   help="save and resume: family[+lora],... (tensors no rank but their owner holds whole)")
    p.add_argument("--keep-going", action="store_true",
                   help="record a family's error as its result (scripts/models_table.py)")
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cases, bf16_cases = [], []
    runs = [(f, False) for f in args.families.split(",") if f] + [(f, True) for f in args.lora.split(",") if f]
    for family, lora in runs:
        run_recorded(lambda family=family, lora=lora: served_case(os.path.join(args.ckpt_root, family), family, lora,
                                                                  world, rank),
                     cases, dict(family=family, lora=lora), args.keep_going, "cases")
    # bf16: one process in bf16 is the oracle (dtypes and bits after init, first-layer routing, bf16 tolerances).
    for family in filter(None, args.bf16.split(",")):
        run_recorded(lambda family=family: bf16_case(os.path.join(args.ckpt_root, family), family, "full", 2, world,
                                                     rank),
                     bf16_cases, dict(family=family, mode="full"), args.keep_going, "bf16_cases")
    roundtrips = []
    for item in filter(None, args.roundtrip.split(",")):
        family, _, lora = item.partition("+")
        roundtrips.append(roundtrip_case(os.path.join(args.ckpt_root, family), family, bool(lora), rank,
                                         with_adapter=with_adapter))
    refused = []
    for item in filter(None, args.refused.split(",")):
        name, directory = item.split("=")
        refused.append(refused_case(os.path.join(args.ckpt_root, directory), name))
    return {"cases": cases, "bf16_cases": bf16_cases, "refused": refused, "roundtrips": roundtrips}


def run_recorded(case, cases: list, names: dict, keep_going: bool, key: str) -> None:
    """Append ``case()``'s result to ``cases`` (the result file's ``key``); with ``keep_going``, an error is
    recorded as the case's result."""
    try:
        cases.append(case())
    except Exception as exc:  # noqa: BLE001 - recorded as this family's result
        if not keep_going:
            raise
        cases.append(dict(names, error_type=type(exc).__name__, error=str(exc)))
        worker_common.write_result({key: cases})
        # Our own errors are raised by every rank at the same point; any other error may leave
        # the ranks in different collectives, so this launch ends here.
        if not isinstance(exc, TwinkleError):
            raise


if __name__ == "__main__":
    worker_common.run(main)
