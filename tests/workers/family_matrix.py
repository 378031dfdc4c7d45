"""The MoE family matrix: memory_efficient_init + EP + FSDP2 against a single process, one launch for all.

For each served family (optionally with LoRA on its experts): the gathered
weights right after wrapping equal the single-process model's bit for bit,
each rank's local experts are its own, the logits match, and so do the loss
and the gradient norm after one backward. For each refused model, wrap_model
raises on every rank (the error is recorded and the next case runs: a refusal
happens before any collective, so the ranks stay in step).
"""

import argparse
import collections
import contextlib
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import worker_common  # noqa: E402
from bf16_parity import run_case as bf16_case  # noqa: E402
from mem_init import exact_mismatches, local_batch, own_experts_ok  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.errors import TwinkleError  # noqa: E402
from twinkle_strategy.loading import model_class_for  # noqa: E402
from twinkle_strategy.train.tiny_models import VISION_LANGUAGE_FAMILIES  # noqa: E402

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


def roundtrip_case(path: str, family: str, lora: bool, rank: int) -> dict:
    """Init, then save (a Hugging Face checkpoint, or an adapter run's trainable files) and read it back into
    zeroed shards: the files must load with plain from_pretrained, the shards come back bit for bit, and a
    tensor that cannot be written or read as rows is held whole by one owner rank only."""
    from twinkle_strategy.checkpoint.model_files import read_model_files, save_model_config, save_model_files
    from twinkle_strategy.checkpoint.optimizer_files import TrainableFiles, read_trainable_files
    from twinkle_strategy.checkpoint.sharded_io import IOStats, regions_of
    from twinkle_strategy.checkpoint.whole_tensors import owner_of
    from twinkle_strategy.dtensor import local_tensor
    from twinkle_strategy.fail_together import step_reporter

    reference = with_adapter(load_single_process(path), lora, family)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference
    # Small buckets: a tensor read whole must still be read once per node, not once per chunk or receiver.
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, timeout_s=120,
                                  init_bucket_mb=1 / 1024)
    with counting_whole_reads() as whole_reads:
        model, _ = strategy.wrap_model(with_adapter(strategy.from_pretrained(path), lora, family))
    init_whole = strategy.init_report.whole_tensors
    out = os.path.join(os.environ["TWINKLE_TEST_OUT"], f"roundtrip-{family}{'-lora' if lora else ''}")
    if rank == 0:
        os.makedirs(out)
    dist.barrier()
    saved, read = IOStats(), IOStats()
    names = {n for n, p in model.named_parameters() if p.requires_grad} if lora else None
    regions = regions_of(model, strategy.ep_plan, names=names)
    if lora:
        files = TrainableFiles(model, strategy.ep_plan, max_file_bytes=2**20)
        if rank == 0:
            files.create(out)
        dist.barrier()
        assert files.write(out, chunk_bytes=4096, stats=saved) is None
    else:
        save_model_files(out, model, ep_plan=strategy.ep_plan, stats=saved, max_file_bytes=2**20, chunk_bytes=4096,
                         step_done=step_reporter("roundtrip save"))
        if rank == 0:
            save_model_config(out, model)
    dist.barrier()
    loaded_mismatches = []
    if rank == 0 and not lora:  # plain transformers reads what every rank wrote
        loaded = model_class_for(AutoConfig.from_pretrained(out)).from_pretrained(out, dtype=torch.float32)
        loaded_mismatches = exact_mismatches(loaded.state_dict(), state)
    with torch.no_grad():
        for region in regions:
            region.local.zero_()
    (read_trainable_files if lora else read_model_files)(out, model, strategy.ep_plan, read)
    resumed = strategy.full_state_dict(model)
    resumed_mismatches = exact_mismatches({k: resumed[k] for k in (names or resumed)},
                                          {k: state[k] for k in (names or state)})
    world = dist.get_world_size()
    owner_failure = failing_owner_read(out, model, strategy, rank) if family == "bailing_hybrid" else None
    adapter, adapter_received, adapter_mismatches = {}, {}, []
    if lora:  # the adapter as the trainer saves it
        adapter, adapter_received = received_bytes(
            lambda: strategy.full_state_dict(model, rank0_only=True, keys=names))
        if rank == 0:
            adapter_mismatches = exact_mismatches(adapter, {k: state[k] for k in names})
    mine = sum(local_tensor(r.local).numel() * r.local.element_size() for r in regions)
    return dict(
        family=family, lora=lora, init_whole=init_whole, whole_reads=dict(whole_reads), owner_failure=owner_failure,
        loaded_mismatches=loaded_mismatches,
        resumed_mismatches=resumed_mismatches, adapter_keys=len(adapter), adapter_keys_total=len(names or ()), adapter_mismatches=adapter_mismatches,
        adapter_received=adapter_received, gathered=saved.gathered, bytes_received=saved.bytes_received,
        bytes_read=read.bytes_read, local_bytes=mine,
        # Tensors this rank owns (it alone holds them whole when they must be), and their full bytes.
        owned={r.name: math.prod(r.full_shape) * r.need.dtype.itemsize for r in regions
               if owner_of(r.name, world) == rank},
        runs={r.name: len(r.runs) for r in regions if r.runs is not None and len(r.runs) > 1},
    )


FAILING_WHOLE_READ = "model.layers.0.self_attn.conv1d.weight"


def failing_owner_read(directory: str, model, strategy, rank: int) -> dict:
    """Resume again, the owner of a tensor served whole failing to read it: every rank must raise, naming it."""
    from twinkle_strategy.checkpoint.layout import CheckpointLayout
    from twinkle_strategy.checkpoint.model_files import read_model_files
    from twinkle_strategy.checkpoint.sharded_io import IOStats
    from twinkle_strategy.checkpoint.whole_tensors import owner_of

    owner = owner_of(FAILING_WHOLE_READ, dist.get_world_size())
    real = CheckpointLayout.read_rows

    def read_rows(self, name, rows=None):
        if rank == owner and name == FAILING_WHOLE_READ and rows is None:
            raise OSError(f"injected read failure of {name}")
        return real(self, name, rows)

    CheckpointLayout.read_rows = read_rows
    start = time.perf_counter()
    try:
        read_model_files(directory, model, strategy.ep_plan, IOStats())
        error = None
    except Exception as exc:  # noqa: BLE001 - the test checks type and message
        error = f"{type(exc).__name__}: {exc}"
    finally:
        CheckpointLayout.read_rows = real
    return dict(owner=owner, error=error, seconds=time.perf_counter() - start)


@contextlib.contextmanager
def counting_whole_reads():
    """How many times each model tensor was read whole from the checkpoint (buffers, rules needing it whole)."""
    from twinkle_strategy.checkpoint.layout import CheckpointLayout

    counts = collections.Counter()
    real = CheckpointLayout.read_rows

    def read_rows(self, name, rows=None):
        if rows is None:
            counts[name] += 1
        return real(self, name, rows)

    CheckpointLayout.read_rows = read_rows
    try:
        yield counts
    finally:
        CheckpointLayout.read_rows = real


def received_bytes(call):
    """``call()``'s result, and the tensor bytes this rank received in it: (point-to-point, all_gather)."""
    counts = {"p2p": 0, "all_gather": 0}
    real_batch, real_all_gather = dist.batch_isend_irecv, dist.all_gather

    def batch(ops):
        counts["p2p"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.irecv)
        return real_batch(ops)

    def all_gather(parts, tensor, *args, **kwargs):
        counts["all_gather"] += sum(p.numel() * p.element_size() for p in parts) - tensor.numel() * tensor.element_size()
        return real_all_gather(parts, tensor, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_gather = batch, all_gather
    try:
        return call(), counts
    finally:
        dist.batch_isend_irecv, dist.all_gather = real_batch, real_all_gather


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
        run_recorded(lambda: served_case(os.path.join(args.ckpt_root, family), family, lora, world, rank),
                     cases, dict(family=family, lora=lora), args.keep_going, "cases")
    # bf16: one process in bf16 is the oracle (dtypes and bits after init, first-layer routing, bf16 tolerances).
    for family in filter(None, args.bf16.split(",")):
        run_recorded(lambda: bf16_case(os.path.join(args.ckpt_root, family), family, "full", 2, world, rank),
                     bf16_cases, dict(family=family, mode="full"), args.keep_going, "bf16_cases")
    roundtrips = []
    for item in filter(None, args.roundtrip.split(",")):
        family, _, lora = item.partition("+")
        roundtrips.append(roundtrip_case(os.path.join(args.ckpt_root, family), family, bool(lora), rank))
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
