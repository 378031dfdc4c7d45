"""LoRA on fused experts at EP: ``lora_experts: activations`` against ``lora_experts: peft``, one launch for all.

For each family, both paths run the same steps on the same ranks (memory_efficient_init, ep=2, FSDP2; ``--ep1``:
without EP):
the loss, and this rank's shard of every gradient, must agree (fp32: 1e-5); the experts modules carry
the classes in the right order (EP outermost, then LoRA on the activations, then PEFT's wrapper) on the
activations path and no LoRA mixin on PEFT's. In bf16 (``--bf16``): the first MoE layer's routing is
identical and the loss within two bf16 ulps (tests/unit/test_lora_experts.py says why).

``--rows`` (one checkpoint, fp32, ep=2; its intermediate size unlike its hidden size, so shapes tell tensors apart): what the received rows cost. LoRA on the experts and LoRA on attention alone
run the same step, counting the all-to-alls in the forward and in the backward and the tensors the forward saves
for the backward that have a received-rows shape: the activations path sends the rows again in the backward
instead of keeping them. And the same family with layer-level activation checkpointing, whose record keeps the
rows received, against PEFT's path (fp32, 1e-5).
"""

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: lora_experts_cases

import torch  # noqa: E402
import worker_common  # noqa: E402
from lora_experts_cases import with_expert_lora  # noqa: E402
from mem_init import local_batch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.distributed.dtensor import local_tensor  # noqa: E402
from twinkle_strategy.fsdp import find_decoder_layers  # noqa: E402
from twinkle_strategy.moe.discovery import find_moe_blocks  # noqa: E402
from twinkle_strategy.moe.lora_experts import LoraOnActivationsExperts  # noqa: E402
from twinkle_strategy.moe.parallel_experts import ExpertParallelExperts  # noqa: E402
from twinkle_strategy.moe.recompute import apply_activation_checkpointing  # noqa: E402


def class_order(model) -> list[list[str]]:
    """Per experts module, the mixins in its class's MRO, outermost first."""
    mixins = (ExpertParallelExperts, LoraOnActivationsExperts)
    found = []
    for block in find_moe_blocks(model):
        mro = type(block.experts).__mro__
        found.append([m.__name__ for m in sorted((m for m in mixins if m in mro), key=mro.index)])
    return found


def run_path(path: str, mode: str, dtype: torch.dtype, ep: int, world: int, rank: int, *,
             checkpointing: bool = False) -> dict:
    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="no", lora_experts=mode, timeout_s=120)
    model = with_expert_lora(strategy.from_pretrained(path, dtype=dtype))
    model, _ = strategy.wrap_model(model)
    if checkpointing:
        apply_activation_checkpointing(find_decoder_layers(model))
    _, mine = local_batch(AutoConfig.from_pretrained(path).get_text_config().vocab_size, world, rank)
    first = find_moe_blocks(model)[0].experts
    routes = []
    # The block's call: (hidden_states, top_k_index, top_k_weights), or Llama-4's (routed_in,).
    handle = first.register_forward_pre_hook(lambda module, args: routes.append([a.detach() for a in args]))
    model.train()
    loss = model(input_ids=mine, labels=mine).loss
    handle.remove()
    loss.backward()
    grads = {name: local_tensor(p.grad).float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return dict(loss=float(strategy.reduce_mean(loss.detach())), grads=grads, routes=routes[0],
                classes=class_order(model))


def compare(family: str, dtype: torch.dtype, world: int, rank: int, ckpt_root: str, ep: int = 2, *,
            checkpointing: bool = False) -> dict:
    path = os.path.join(ckpt_root, family)
    peft = run_path(path, "peft", dtype, ep, world, rank, checkpointing=checkpointing)
    ours = run_path(path, "activations", dtype, ep, world, rank, checkpointing=checkpointing)
    grad_diffs = {name: float((ours["grads"][name] - ref).abs().max()) / max(1.0, float(ref.abs().max()))
                  for name, ref in peft["grads"].items() if name in ours["grads"] and ref.numel()}
    return dict(
        family=family, dtype=str(dtype), ep=ep, checkpointing=checkpointing, loss=ours["loss"], ref_loss=peft["loss"],
        same_grad_names=sorted(ours["grads"]) == sorted(peft["grads"]),
        expert_lora_grads=len([n for n in peft["grads"] if ".experts." in n and "lora_" in n]),
        max_grad_diff=max(grad_diffs.values()), worst_grad=max(grad_diffs, key=grad_diffs.get),
        same_first_routing=all(torch.equal(a, b) for a, b in zip(ours["routes"], peft["routes"], strict=True)),
        classes=ours["classes"], ref_classes=peft["classes"],
    )


class AllToAllLog:
    """Counts ``all_to_all_single`` calls (still made) and the row counts of the hidden-sized ones."""

    def __init__(self, hidden_size: int):
        self.hidden_size, self.calls, self.row_counts = hidden_size, 0, set()

    @contextlib.contextmanager
    def counting(self):
        real = torch.distributed.all_to_all_single

        def counted(output, tensor, *args, **kwargs):
            self.calls += 1
            if output.dim() == 2 and output.shape[-1] == self.hidden_size:
                self.row_counts.add(output.shape[0])
            return real(output, tensor, *args, **kwargs)

        torch.distributed.all_to_all_single = counted
        try:
            yield self
        finally:
            torch.distributed.all_to_all_single = real


def received_rows_cost(path: str, expert_lora: bool, world: int, rank: int) -> dict:
    """One fp32 step at ep=2 with LoRA on attention and (``expert_lora``) the experts, on the activations path:
    all-to-alls in the forward and the backward, and the saved tensors shaped like rows this rank received."""
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", lora_experts="activations", timeout_s=120)
    model = strategy.from_pretrained(path, dtype=torch.float32)
    model = with_expert_lora(model, **({} if expert_lora else {"target_parameters": []}))
    model, _ = strategy.wrap_model(model)
    config = AutoConfig.from_pretrained(path).get_text_config()
    _, mine = local_batch(config.vocab_size, world, rank)
    forward, backward = AllToAllLog(config.hidden_size), AllToAllLog(config.hidden_size)
    saved_shapes = []

    def pack(t: torch.Tensor):
        if t.untyped_storage().nbytes() == t.numel() * t.element_size():  # (a view is its base tensor's)
            saved_shapes.append(tuple(t.shape))
        return t

    model.train()
    with forward.counting(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=mine, labels=mine).loss
    with backward.counting():
        loss.backward()
    received = {rows for rows in forward.row_counts if rows != mine.numel()}  # (not the tokens' own count)
    kept = [shape for shape in saved_shapes if len(shape) == 2 and shape[-1] == config.hidden_size
            and shape[0] in received]
    return dict(forward_all_to_alls=forward.calls, backward_all_to_alls=backward.calls, received_counts=sorted(received),
                kept_received_rows=len(kept), moe_layers=len(find_moe_blocks(model)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--families", required=True)
    p.add_argument("--bf16", default="", help="families also compared in bf16")
    p.add_argument("--ep1", default="", help="families also compared without expert parallelism (FSDP2 only)")
    p.add_argument("--rows", default="", help="a family whose received rows' cost is measured (see the docstring)")
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cases = [compare(f, torch.float32, world, rank, args.ckpt_root) for f in args.families.split(",") if f]
    cases += [compare(f, torch.bfloat16, world, rank, args.ckpt_root) for f in args.bf16.split(",") if f]
    cases += [compare(f, torch.float32, world, rank, args.ckpt_root, ep=1) for f in args.ep1.split(",") if f]
    result = {"cases": cases}
    if args.rows:
        path = os.path.join(args.ckpt_root, args.rows)
        result["rows"] = {"experts": received_rows_cost(path, True, world, rank),
                          "attention": received_rows_cost(path, False, world, rank),
                          "checkpointed": compare(args.rows, torch.float32, world, rank, args.ckpt_root,
                                                  checkpointing=True)}
    return result


if __name__ == "__main__":
    worker_common.run(main)
