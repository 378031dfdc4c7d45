"""Quantized hub releases streamed with memory_efficient_init: every rank's shards against an oracle, the bytes
read and received against what the format needs, and broken scales named on every rank.

Cases (``--cases name=path:oracle,...``), oracle one of:
* ``transformers``: plain ``from_pretrained`` of the release (it dequantizes on CPU), bit for bit;
* ``reference``: plain ``from_pretrained`` of ``<path>.reference``, the release dequantized by the test's own
  implementation of the format's definition (transformers gets ragged FP8 edges wrong);
* ``error``: loading must fail on every rank (the test checks the key it names).
``+verify``: with verify_init. ``+save``: then save the model (full parameters) and load the result with plain
``from_pretrained`` on one rank: a bf16 checkpoint without a quantization_config, equal to the oracle.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402
from twinkle_strategy.checkpoint.reading import SafetensorsIndex  # noqa: E402
from twinkle_strategy.loading import model_class_for  # noqa: E402
from twinkle_strategy.shards.plan import checkpoint_runs, needs_of, region_of  # noqa: E402

DTYPE = torch.bfloat16


def transformers_state(path: str) -> dict:
    config = AutoConfig.from_pretrained(path)
    model = model_class_for(config).from_pretrained(path, dtype=DTYPE)
    return {**dict(model.named_buffers()), **model.state_dict()}  # RoPE inv_freq too


def shard_mismatches(model, strategy, state) -> list[str]:
    bad = []
    for need, local in needs_of(model, strategy.ep_plan):
        want = state[need.name]
        want = region_of(want, need, strategy.ep_plan)
        if want.dtype != local.dtype or want.shape != local.shape or not torch.equal(want, local.cpu()):
            bad.append(need.name)
    return bad


def stored_bytes_bound(model, strategy, index: SafetensorsIndex, block) -> int:
    """What a rank's shards are as the release stores them: FP8 rows and the scale rows they need, whole
    per-expert FP8 tensors and their scales for expert rows, values for everything else."""
    if not any(key.endswith("_scale_inv") for key in index.tensors):
        return None  # DeepSeek-V4 and MXFP4: the test checks the ratio of bytes instead
    total = 0
    for need, _local in needs_of(model, strategy.ep_plan):
        name = need.name
        if name in index.tensors and name + "_scale_inv" in index.tensors and need.rows is not None:
            a, b = need.rows
            scale = index.tensors[name + "_scale_inv"]
            total += (b - a) * need.shape[1] + (math.ceil(b / block[0]) - a // block[0]) * scale.row_bytes
        elif ".experts." in name and need.rows is not None:
            prefix, proj = name.rsplit(".experts.", 1)
            runs = checkpoint_runs(need, strategy.ep_plan, model.get_parameter(name).shape)
            slots = [slot for a, b in runs for slot in range(a, b)]  # (LongCat's zero-computation slots too)
            parts = ("gate_proj", "up_proj") if proj == "gate_up_proj" else ("down_proj",)
            for expert in slots:
                for part in parts:
                    key = f"{prefix}.experts.{expert}.{part}.weight"
                    total += index.tensors[key].nbytes + index.tensors[key + "_scale_inv"].nbytes
        else:
            total += need.nbytes
    return total


def saved_checkpoint_check(strategy, model, directory: str, state: dict) -> dict:
    import torch.distributed as dist

    strategy.save_pretrained(model, directory)
    if dist.get_rank() != 0:
        return {}
    with open(os.path.join(directory, "config.json")) as f:
        saved_config = json.load(f)
    index = SafetensorsIndex.from_directory(directory)
    reloaded = transformers_state(directory)
    return dict(saved_has_quantization_config="quantization_config" in saved_config,
                saved_dtypes=sorted({str(t.dtype) for t in index.tensors.values()}),
                saved_mismatches=sorted(k for k in state if not torch.equal(reloaded[k], state[k])))


def good_case(path: str, oracle: str, block, nnodes: int, save_dir: str | None, verify: bool) -> dict:
    state = transformers_state(path if oracle == "transformers" else path + ".reference")
    # verify_init: every receiver's dequantized shards also match, by CRC32, what its source decodes itself
    # (the source reads its node's rows twice for that).
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, verify_init=verify)
    model = strategy.from_pretrained(path, dtype=DTYPE)
    model, _ = strategy.wrap_model(model)
    report = strategy.init_report
    index = SafetensorsIndex.from_directory(path)
    node_share = sum(t.nbytes for t in index.tensors.values()) / nnodes
    saved = saved_checkpoint_check(strategy, model, save_dir, state) if save_dir else {}
    return dict(
        **saved, verified=verify, mismatches=shard_mismatches(model, strategy, state), is_source=report.is_source,
        read_ratio=report.bytes_read / node_share, received=report.bytes_received,
        received_decoded=report.bytes_received_decoded, sent=report.bytes_sent, sent_decoded=report.bytes_sent_decoded,
        stored_bound=stored_bytes_bound(model, strategy, index, block), shard_bytes=report.shard_bytes,
        buffer_bytes=report.buffer_bytes, has_quantization_config=hasattr(model.config, "quantization_config"),
        log_line=report.log_line())


def error_case(path: str) -> dict:
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True)
    try:
        model = strategy.from_pretrained(path, dtype=DTYPE)
        strategy.wrap_model(model)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        return dict(error_type=type(exc).__name__, error=str(exc))
    return dict(error_type=None, error=None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--block", default="16,16")
    p.add_argument("--save-root", required=True)
    args = p.parse_args()
    block = tuple(int(x) for x in args.block.split(","))
    nnodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    results = {}
    for case in args.cases.split(","):
        name, spec = case.split("=", 1)
        path, oracle = spec.rsplit(":", 1)
        oracle, *flags = oracle.split("+")
        save_dir = os.path.join(args.save_root, name) if "save" in flags else None
        results[name] = error_case(path) if oracle == "error" else good_case(path, oracle, block, nnodes, save_dir,
                                                                             "verify" in flags)
        worker_common.write_result({"cases": results})
    return {"cases": json.loads(json.dumps(results, default=str))}


if __name__ == "__main__":
    worker_common.run(main)
