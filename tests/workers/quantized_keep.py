"""LoRA over a quantized release kept as stored (``quantized_base: keep``) against the same run dequantized.

Cases (``--cases name=path:family[+ckpt],...``): for each, three LoRA steps (attention and expert adapters,
SGD) with ``dequantize`` and with ``keep`` on the same global batch; ``+ckpt`` adds a ``keep`` run with
activation checkpointing. Records per rank: logits of the first step, losses, every LoRA gradient (this
rank's shard), which parameters are kept and the dtypes of what they store, CRC32s of the stored bytes
before and after the steps, the init report's frozen bytes, the step log's figures and each kept region
decoded on the meta device. A ``refuse`` case trains a quantized weight with ``keep``, an ``unserved`` case
keeps a release of a format the streamed init does not serve; each records the error on every rank, and the
weight files opened after it.
"""

import argparse
import json
import os
import sys
import zlib

sys.path.insert(0, os.path.dirname(__file__))

import keep_export  # noqa: E402
import torch  # noqa: E402
import worker_common  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.fsdp import find_decoder_layers  # noqa: E402
from twinkle_strategy.moe.recompute import apply_activation_checkpointing  # noqa: E402
from twinkle_strategy.quantized.kept import (  # noqa: E402
    DECODE_STATS,
    KeptRegion,
    KeptWeight,
    _padded_shard_bytes,
    kept_weight_log,
    largest_unit_decode_bytes,
)

SEQ, PER_RANK, STEPS = 16, 2, 3

# The files this process opens while recording (Python's audit hooks see every open() and os.open()).
OPENED: list[str] = []
RECORDING = [False]


def _record_opens(event, args):
    if RECORDING[0] and event == "open" and isinstance(args[0], (str, os.PathLike)):
        OPENED.append(os.path.realpath(os.fspath(args[0])))


sys.addaudithook(_record_opens)


def opened_while(action) -> list[str]:
    """The files opened while ``action()`` runs (or raises)."""
    OPENED.clear()
    RECORDING[0] = True
    try:
        action()
    finally:
        RECORDING[0] = False
    return list(OPENED)
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


def step(strategy, model, optimizer, mine, *, between: dict | None = None) -> tuple[float, dict, torch.Tensor]:
    """One SGD step: the global mean loss, this rank's LoRA gradients and its logits. ``between`` gets what is
    decoded between the forward and the backward: decoded shards alive, and the weights still kept as stored."""
    out = model(input_ids=mine, labels=mine)
    if between is not None:
        between.update(alive=DECODE_STATS.alive_bytes, kept=sorted(kept_weights(model)))
    out.loss.backward()
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).float().clone()
             for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad()
    return float(strategy.reduce_mean(out.loss)), grads, out.logits.detach().float()


def decoded_on_meta(kept: dict[str, KeptWeight]) -> list[str]:
    """The kept regions whose decode does not run on the device of their stored bytes: each region's bytes moved
    to the meta device (no data) and decoded there. Reading a value back to the host (``.item()``, ``.cpu()``,
    ``.tolist()``) or mixing in a host tensor fails on meta, so a decode that passes stays on the device."""
    bad = []
    for name, weight in kept.items():
        region = weight.region
        try:
            out = KeptRegion(region.name, region.form, region.stored.to("meta"), region.rows_shape,
                             region.config).dequantize()
            if out.device.type != "meta" or tuple(out.shape) != region.rows_shape or out.dtype != weight.dtype:
                bad.append(f"{name}: {out.device} {tuple(out.shape)} {out.dtype}")
        except Exception as exc:  # noqa: BLE001 - the test reads it
            bad.append(f"{name}: {type(exc).__name__}: {exc}")
    return bad


def run(path: str, family: str, mode: str, mine, *, ep: int, checkpointing: bool = False) -> dict:
    strategy, model, optimizer = build(path, family, mode, ep=ep, checkpointing=checkpointing)
    kept = kept_weights(model)
    before = crc(kept)
    losses, grads, logits = [], [], []
    DECODE_STATS.reset_peak()
    decoded_before = DECODE_STATS.decoded_bytes
    alive_before = DECODE_STATS.alive_bytes
    between = {}
    for _ in range(STEPS):
        loss, grad, logit = step(strategy, model, optimizer, mine, between=between)
        losses.append(loss)
        grads.append(grad)
        logits.append(logit)
    report = strategy.init_report
    peak = DECODE_STATS.peak_alive_bytes
    step_log = kept_weight_log(report)  # what the trainer's step log adds (and resets the peak, as it does)
    return dict(losses=losses, grads=grads, logits=logits[0], kept=sorted(kept),
                stored_dtypes={name: stored_dtypes(k) for name, k in kept.items()},
                crc_before=before, crc_after=crc(kept), frozen_stored=report.frozen_stored_bytes,
                frozen_values=report.frozen_values_bytes, held=report.frozen_held_bytes,
                frozen_decoded=report.frozen_decoded, log_line=report.log_line(),
                model=model, strategy=strategy, decoded_peak=peak,
                decoded=DECODE_STATS.decoded_bytes - decoded_before, largest_unit=largest_unit_decode_bytes(model),
                kept_shards=sum(_padded_shard_bytes(p) for p in model.parameters()),
                # Nothing stays decoded after the steps: no decoded shard alive, every kept weight back in its
                # stored form (FSDP2 resharded the units: no gathered, decoded weight left on a module).
                alive_after=DECODE_STATS.alive_bytes - alive_before, kept_after=sorted(kept_weights(model)),
                alive_between=between["alive"] - alive_before, kept_between=between["kept"],
                step_log=step_log, peak_after_log=DECODE_STATS.peak_alive_bytes,
                meta_decode_failures=decoded_on_meta(kept))


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
    step again. It reads back only the adapter and optimizer state (the frozen base comes from the init, which
    reads what the first run's init read: each node's share of the release, as stored). Records what each
    init read from the release, what the checkpoint load read (bytes, files opened) and the checkpoint's
    tensor bytes."""
    from twinkle_strategy.checkpoint.reading import IOStats
    from twinkle_strategy.checkpoint.training import load_checkpoint, save_checkpoint

    directory = os.path.join(root, "checkpoint-2")
    strategy, model, optimizer = build(path, family, "keep", ep=ep)
    first_init = strategy.init_report
    for _ in range(2):
        step(strategy, model, optimizer, mine)
    save_checkpoint(directory, model, strategy, optimizer=optimizer, scheduler=None, trainer_state={"global_step": 2})
    crc_saved = crc(kept_weights(model))
    continued = step(strategy, model, optimizer, mine)[0]
    strategy, model, optimizer = build(path, family, "keep", ep=ep)
    stats = IOStats()
    opened = opened_while(lambda: load_checkpoint(directory, model, strategy, optimizer=optimizer, scheduler=None,
                                                  expect={}, stats=stats))
    resumed = step(strategy, model, optimizer, mine)[0]
    checkpoint_files = [os.path.relpath(os.path.join(d, f), directory) for d, _, fs in os.walk(directory) for f in fs]
    return dict(continued=continued, resumed=resumed, base_unchanged=crc(kept_weights(model)) == crc_saved,
                files=sorted(checkpoint_files), init_read=[first_init.bytes_read, strategy.init_report.bytes_read],
                init_stored=[first_init.frozen_stored_bytes, strategy.init_report.frozen_stored_bytes],
                load_read=stats.bytes_read, state_tensor_bytes=tensor_bytes(os.path.join(directory, "trainer_state")),
                load_opened=sorted({os.path.relpath(f, directory) if f.startswith(os.path.realpath(directory))
                                    else f for f in opened if f.endswith(".safetensors")}),
                release_opened=sorted(f for f in opened if f.startswith(os.path.realpath(path))))


def tensor_bytes(directory: str) -> int:
    """The tensor bytes of every safetensors file under ``directory``, from their headers."""
    from twinkle_strategy.checkpoint.reading import SafetensorsIndex

    files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names if f.endswith(".safetensors")]
    return sum(t.nbytes for t in SafetensorsIndex(files).tensors.values()) if files else 0


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

    from twinkle_strategy.checkpoint.reading import SafetensorsIndex
    from twinkle_strategy.loading import load_config
    from twinkle_strategy.quantized.formats import QuantizedIndex, quant_format
    from twinkle_strategy.testing.releases import _v4_release_key

    release_dir, bf16_dir, reloaded_dir = (os.path.join(root, d) for d in ("merged-release", "merged-bf16",
                                                                            "reloaded"))
    exports = keep_export.run_exports(keep["strategy"], keep["model"], path, os.path.join(root, "exports"))
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
                attention_oracle=oracle, weight_export=keep_export.compare(
                    exports, os.path.join(root, "exports"), release_dir=release_dir, bf16_dir=bf16_dir,
                    adapter_dir=adapter_dir, modules=modules, checkpoint_tensors=checkpoint_tensors),
                reloaded_equal_bf16=sorted(reloaded) == sorted(bf16)
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
               largest_unit=keep["largest_unit"], kept_shards=keep["kept_shards"], ref_decoded=ref["decoded"],
               frozen_decoded=keep["frozen_decoded"], alive_after=keep["alive_after"],
               kept_after=keep["kept_after"], step_log=keep["step_log"], ref_step_log=ref["step_log"],
               alive_between=keep["alive_between"], kept_between=keep["kept_between"],
               peak_after_log=keep["peak_after_log"], meta_decode_failures=keep["meta_decode_failures"])
    if "save" in flags:  # the adapters of both runs, as saved: the same bits
        out["adapter"] = adapter_bytes(keep["strategy"], keep["model"], os.path.join(root, "keep-adapter"))
        out["ref_adapter"] = adapter_bytes(ref["strategy"], ref["model"], os.path.join(root, "dequantize-adapter"))
        out["resume"] = resume_case(path, family, mine, ep=ep, root=root)
    if "export" in flags:
        out["export"] = export_case(keep, ref, path, family, os.path.join(root, "export"))
    if "ckpt" in flags:
        checkpointed = run(path, family, "keep", mine, ep=ep, checkpointing=True)
        out["checkpointed"] = {key: checkpointed[key] for key in ("losses", "decoded", "decoded_peak", "alive_after",
                                                                   "kept_after", "largest_unit", "alive_between",
                                                                   "kept_between")}
    return out


def refuse_case(path: str, ep: int) -> dict:
    """Full-parameter training (every weight trainable) with keep: refused on every rank before weights move.
    Records the error and the files opened while wrap_model ran: the source opens a release file to read a
    tensor's bytes (headers were read by from_pretrained), so none opened means no weight byte was read or sent."""
    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", memory_efficient_init=True, timeout_s=120,
                                  quantized_base="keep")
    model = strategy.from_pretrained(path, dtype=torch.bfloat16)
    error = []

    def wrap():
        try:
            strategy.wrap_model(model)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            error.append(exc)

    opened = opened_while(wrap)
    exc = error[0] if error else None
    return dict(error_type=type(exc).__name__ if exc else None, error=str(exc) if exc else None,
                release_opened=sorted(f for f in opened if f.startswith(os.path.realpath(path))),
                quantized_keys=quantized_keys(path))


def quantized_keys(path: str) -> list[str]:
    """The release's weights stored quantized: those with a scale beside them."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        keys = json.load(f)["weight_map"]
    return sorted(key for key in keys if f"{key}_scale_inv" in keys)


def unserved_case(path: str, ep: int, root: str) -> dict:
    """keep of a release quantized in a format the streamed init does not serve (``awq``: the FP8 release's
    files under a config that says awq): refused by name on every rank, before any weight file is opened."""
    release = os.path.join(root, f"awq-rank{os.environ['RANK']}")
    os.makedirs(release, exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    with open(os.path.join(release, "config.json"), "w") as f:
        json.dump(config, f)
    for file in os.listdir(path):
        if file.endswith((".safetensors", ".json")) and file != "config.json" and \
                not os.path.exists(os.path.join(release, file)):
            os.symlink(os.path.join(path, file), os.path.join(release, file))
    strategy = NativeFSDPStrategy(ep_size=ep, mixed_precision="bf16", memory_efficient_init=True, timeout_s=120,
                                  quantized_base="keep")
    error = []

    def load():
        try:
            strategy.wrap_model(strategy.from_pretrained(release, dtype=torch.bfloat16))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            error.append(exc)

    opened = opened_while(load)
    exc = error[0] if error else None
    return dict(error_type=type(exc).__name__ if exc else None, error=str(exc) if exc else None,
                weight_files_opened=sorted(f for f in opened if f.endswith(".safetensors")))


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
        root = os.path.join(args.save_root, name)
        if family == "refuse":
            results[name] = refuse_case(path, args.ep)
        elif family == "unserved":
            results[name] = unserved_case(path, args.ep, root)
        else:
            results[name] = good_case(path, family, flags, args.ep, world, rank, root)
        worker_common.write_result({"cases": results})
    return {"cases": results}


if __name__ == "__main__":
    worker_common.run(main)
