"""LoRA over a quantized release kept as stored (``quantized_base: keep``) against the same run dequantized.

Cases (``--cases name=path:family[+ckpt],...``): for each, three LoRA steps (attention and expert adapters,
SGD) with ``dequantize`` and with ``keep`` on the same global batch; ``+ckpt`` adds a ``keep`` run with
activation checkpointing. Records per rank: logits of the first step, losses, every LoRA gradient (this
rank's shard), which parameters are kept and the dtypes of what they store, CRC32s of the stored bytes
before and after the steps, and the init report's frozen bytes. A ``refuse`` case trains a quantized weight
with ``keep`` and records the error.
"""

import argparse
import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.fsdp import find_decoder_layers  # noqa: E402
from twinkle_strategy.moe.recompute import apply_activation_checkpointing  # noqa: E402
from twinkle_strategy.quantized.kept import (  # noqa: E402
    DECODE_STATS,
    KeptWeight,
    _padded_shard_bytes,
    largest_unit_decode_bytes,
)

SEQ, PER_RANK, STEPS = 16, 2, 3
LORA_SEED = 7
ATTENTION = {"deepseek_v3": ["q_b_proj", "kv_a_proj_with_mqa", "o_proj"], "deepseek_v4": ["q_b_proj", "o_b_proj"],
             "gpt_oss": ["q_proj", "o_proj"]}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def with_adapter(model, family: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(LORA_SEED)  # the same fresh adapter on every rank and in both modes
    # init_lora_weights=False: lora_B is random too, so the base's values reach the adapters' gradients.
    config = LoraConfig(r=2, lora_alpha=4, target_modules=ATTENTION[family], target_parameters=EXPERTS,
                        init_lora_weights=False)
    return get_peft_model(model, config)


def kept_weights(model) -> dict[str, KeptWeight]:
    out = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if isinstance(local, KeptWeight):
            out[name] = local
    return out


def stored_dtypes(kept: KeptWeight) -> list[str]:
    """The dtypes of what a kept weight stores: its pieces (data, scale) as the release's parts."""
    form = kept.region.form
    return sorted({str(part.dtype) for chunk in form.chunks for piece in chunk.pieces if piece.codec
                   for part in piece.codec.parts})


def crc(kept: dict[str, KeptWeight]) -> dict[str, int]:
    return {name: zlib.crc32(k.region.stored.cpu().numpy().tobytes()) for name, k in kept.items()}


def build(path: str, family: str, mode: str, *, ep: int, checkpointing: bool = False):
    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", memory_efficient_init=True, timeout_s=300,
                                  quantized_base=mode)
    model = with_adapter(strategy.from_pretrained(path, dtype=torch.bfloat16), family)
    model, _ = strategy.wrap_model(model)
    if checkpointing:
        apply_activation_checkpointing(find_decoder_layers(model))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    return strategy, model, optimizer


def step(strategy, model, optimizer, mine) -> tuple[float, dict, torch.Tensor]:
    """One SGD step: the global mean loss, this rank's LoRA gradients and its logits."""
    out = model(input_ids=mine, labels=mine)
    out.loss.backward()
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad()
    return float(strategy.reduce_mean(out.loss)), grads, out.logits.detach().float()


def run(path: str, family: str, mode: str, mine, *, ep: int, checkpointing: bool = False) -> dict:
    strategy, model, optimizer = build(path, family, mode, ep=ep, checkpointing=checkpointing)
    kept = kept_weights(model)
    before = crc(kept)
    losses, grads, logits = [], [], []
    DECODE_STATS.reset_peak()
    decoded_before = DECODE_STATS.decoded_bytes
    for _ in range(STEPS):
        loss, grad, logit = step(strategy, model, optimizer, mine)
        losses.append(loss)
        grads.append(grad)
        logits.append(logit)
    report = strategy.init_report
    return dict(losses=losses, grads=grads, logits=logits[0], kept=sorted(kept),
                stored_dtypes={name: stored_dtypes(k) for name, k in kept.items()},
                crc_before=before, crc_after=crc(kept), frozen_stored=report.frozen_stored_bytes,
                frozen_values=report.frozen_values_bytes, held=report.frozen_held_bytes, log_line=report.log_line(),
                model=model, strategy=strategy, decoded_peak=DECODE_STATS.peak_alive_bytes,
                decoded=DECODE_STATS.decoded_bytes - decoded_before, largest_unit=largest_unit_decode_bytes(model),
                kept_shards=sum(_padded_shard_bytes(p) for p in model.parameters()))


def adapter_bytes(strategy, model, directory: str) -> str | None:
    """The adapter as saved (rank 0 reads its file back): the CRC32 of every tensor's bytes, by key."""
    from safetensors.torch import load_file

    strategy.save_pretrained(model, directory)
    if strategy.rank != 0:
        return None
    saved = load_file(os.path.join(directory, "adapter_model.safetensors"))
    return json.dumps({k: zlib.crc32(v.contiguous().view(torch.uint8).numpy().tobytes()) for k, v in
                       sorted(saved.items())})


def resume_case(path: str, family: str, mine, *, ep: int, root: str) -> dict:
    """keep: two steps, a checkpoint, a third step; then a new run resumed from the checkpoint takes the third
    step again. It reads back only the adapter and optimizer state (the frozen base comes from the init)."""
    from twinkle_strategy.checkpoint.training import load_checkpoint, save_checkpoint

    directory = os.path.join(root, "checkpoint-2")
    strategy, model, optimizer = build(path, family, "keep", ep=ep)
    for _ in range(2):
        step(strategy, model, optimizer, mine)
    save_checkpoint(directory, model, strategy, optimizer=optimizer, scheduler=None, trainer_state={"global_step": 2})
    crc_saved = crc(kept_weights(model))
    continued = step(strategy, model, optimizer, mine)[0]
    strategy, model, optimizer = build(path, family, "keep", ep=ep)
    load_checkpoint(directory, model, strategy, optimizer=optimizer, scheduler=None, expect={})
    resumed = step(strategy, model, optimizer, mine)[0]
    return dict(continued=continued, resumed=resumed, base_unchanged=crc(kept_weights(model)) == crc_saved,
                files=sorted(os.listdir(directory)))


def checkpoint_tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(os.listdir(directory)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, file)))
    return out


def attention_oracle(adapter: dict, base: dict, exported: dict) -> dict:
    """The merged attention weights against PEFT's Linear merge computed here in one process, from the saved
    adapter and the release's decoded values: ``base + (B @ A) * alpha / r``, with the adapter in bf16 as FSDP2's
    mixed precision gathers it for the forward and the export's merge. Independent of how the ranks split rows."""
    checked = mismatched = 0
    for key, merged in exported.items():
        prefix = "base_model.model." + key.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" not in adapter:
            continue
        a, b = (adapter[f"{prefix}.lora_{x}.weight"].to(torch.bfloat16) for x in "AB")
        want = base[key] + (b @ a) * 2.0  # lora_alpha 4 / r 2
        checked += 1
        mismatched += not torch.equal(merged, want)
    return dict(checked=checked, mismatched=mismatched)


def export_case(keep: dict, ref: dict, path: str, family: str, root: str) -> dict | None:
    """merge_lora after the steps: keep's model in the release's format, dequantize's in bf16 (both consumed);
    then the release-format export loaded back (dequantize) and saved in bf16. Rank 0 compares the files."""
    from safetensors import safe_open

    from twinkle_strategy.checkpoint.files import SafetensorsIndex
    from twinkle_strategy.loading import load_config
    from twinkle_strategy.quantized.formats import QuantizedIndex, quant_format
    from twinkle_strategy.testing.releases import _v4_release_key

    release_dir, bf16_dir, reloaded_dir = (os.path.join(root, d) for d in ("merged-release", "merged-bf16",
                                                                            "reloaded"))
    modules = keep["strategy"].save_merged(keep["model"], release_dir, merged_format="release", release=path)
    ref["strategy"].save_merged(ref["model"], bf16_dir)
    strategy = NativeFSDPStrategy(ep_size=keep["strategy"].config.ep_size, mixed_precision="bf16",
                                  memory_efficient_init=True, timeout_s=300)
    model, _ = strategy.wrap_model(strategy.from_pretrained(release_dir, dtype=torch.bfloat16))
    strategy.save_pretrained(model, reloaded_dir)
    if strategy.rank != 0:
        return None
    release, exported, bf16 = (checkpoint_tensors(d) for d in (path, release_dir, bf16_dir))
    # The bf16 export has transformers' key names; DeepSeek-V4-Flash's release has its own (no ``model.``).
    by_release_key = {(_v4_release_key(k) if family == "deepseek_v4" else k): v for k, v in bf16.items()}
    merged_keys = set()
    for file in os.listdir(release_dir):
        if file.startswith("model-merged"):
            with safe_open(os.path.join(release_dir, file), "pt") as reader:
                merged_keys |= set(reader.keys())
    untouched = sorted(set(exported) - merged_keys)
    as_bytes = lambda t: t.contiguous().view(torch.uint8).reshape(-1)  # noqa: E731
    index = QuantizedIndex(SafetensorsIndex.from_directory(path), quant_format(load_config(path)))
    base = {key: index.read(key).to(torch.bfloat16) for key in merged_keys}  # the release's values, decoded
    index.close()
    reloaded = checkpoint_tensors(reloaded_dir)
    adapter_dir = os.path.join(os.path.dirname(root), "keep-adapter")  # saved by the "save" flag, same state
    if os.path.isdir(adapter_dir):
        oracle = attention_oracle(checkpoint_tensors(adapter_dir), base, exported)
    else:
        oracle = None
    return dict(modules=modules, merged=sorted(merged_keys), untouched=untouched,
                dropped=sorted(set(release) - set(exported)),
                untouched_bytes_equal=all(torch.equal(as_bytes(exported[k]), as_bytes(release[k])) for k in untouched),
                untouched_dtypes_equal=all(exported[k].dtype == release[k].dtype for k in untouched),
                merged_dtypes=sorted({str(exported[k].dtype) for k in merged_keys}),
                merged_equal_dequantize=all(torch.equal(exported[k], by_release_key[k]) for k in merged_keys),
                merged_differs_from_base=all(not torch.equal(exported[k], base[k]) for k in merged_keys),
                attention_oracle=oracle, reloaded_equal_bf16=sorted(reloaded) == sorted(bf16)
                and all(torch.equal(reloaded[k], bf16[k]) for k in bf16),
                modules_to_not_convert=json.load(open(os.path.join(release_dir, "config.json")))
                ["quantization_config"]["modules_to_not_convert"])


def compare(keep: dict, ref: dict) -> dict:
    """keep against dequantize: the largest differences of logits and of every LoRA gradient, and the losses."""
    grad_diff = 0.0
    missing = []
    for got, want in zip(keep["grads"], ref["grads"], strict=True):
        missing += sorted(set(want) ^ set(got))
        for name in sorted(set(got) & set(want)):
            if not want[name].numel():  # an empty shard
                continue
            grad_diff = max(grad_diff, (got[name] - want[name]).abs().max().item())
    return dict(logit_diff=(keep["logits"] - ref["logits"]).abs().max().item(), grad_diff=grad_diff,
                grad_count=len(ref["grads"][0]), grad_name_mismatch=missing,
                losses=keep["losses"], ref_losses=ref["losses"])


def good_case(path: str, family: str, flags: list[str], ep: int, world: int, rank: int, root: str) -> dict:
    ids = torch.randint(0, AutoConfig.from_pretrained(path).get_text_config().vocab_size, (world * PER_RANK, SEQ),
                        generator=torch.Generator().manual_seed(99))
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    ref = run(path, family, "dequantize", mine, ep=ep)
    keep = run(path, family, "keep", mine, ep=ep)
    out = dict(**compare(keep, ref), kept=keep["kept"], ref_kept=ref["kept"], stored_dtypes=keep["stored_dtypes"],
               bytes_unchanged=keep["crc_before"] == keep["crc_after"], frozen_stored=keep["frozen_stored"],
               frozen_values=keep["frozen_values"], held=keep["held"], ref_held=ref["held"],
               log_line=keep["log_line"], decoded_peak=keep["decoded_peak"], decoded=keep["decoded"],
               largest_unit=keep["largest_unit"], kept_shards=keep["kept_shards"], ref_decoded=ref["decoded"])
    if "save" in flags:  # the adapters of both runs, as saved: the same bits
        out["adapter"] = adapter_bytes(keep["strategy"], keep["model"], os.path.join(root, "keep-adapter"))
        out["ref_adapter"] = adapter_bytes(ref["strategy"], ref["model"], os.path.join(root, "dequantize-adapter"))
        out["resume"] = resume_case(path, family, mine, ep=ep, root=root)
    if "export" in flags:
        out["export"] = export_case(keep, ref, path, family, os.path.join(root, "export"))
    if "ckpt" in flags:
        out["checkpointed_losses"] = run(path, family, "keep", mine, ep=ep, checkpointing=True)["losses"]
    return out


def refuse_case(path: str, ep: int) -> dict:
    """Full-parameter training (every weight trainable) with keep: refused on every rank before weights move."""
    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", memory_efficient_init=True, timeout_s=120,
                                  quantized_base="keep")
    try:
        strategy.wrap_model(strategy.from_pretrained(path, dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return dict(error_type=type(exc).__name__, error=str(exc), bytes_received=None)
    return dict(error_type=None, error=None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--save-root", required=True)
    args = p.parse_args()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = {}
    for case in args.cases.split(","):
        name, spec = case.split("=", 1)
        path, how = spec.rsplit(":", 1)
        family, *flags = how.split("+")
        results[name] = (refuse_case(path, args.ep) if family == "refuse"
                         else good_case(path, family, flags, args.ep, world, rank,
                                        os.path.join(args.save_root, name)))
        worker_common.write_result({"cases": results})
    return {"cases": results}


if __name__ == "__main__":
    worker_common.run(main)
