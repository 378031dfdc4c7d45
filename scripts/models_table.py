"""Run every MoE family of the installed transformers through EP + FSDP2; write docs/models.md.

A family is a class behind ``AutoModelForCausalLM`` or ``AutoModelForImageTextToText``
whose modeling code has an ``experts`` module. For each one:

1. a tiny checkpoint (``twinkle_strategy.testing.tiny_models.tiny_config``: written by
   hand for the families the tests run, the config's own defaults shrunk for
   the others);
2. what expert parallelism reads from its code: the experts module, the call
   contract and the expert tensors, or why it refuses the model;
3. the family-matrix worker of the test suite (``tests/workers/family_matrix.py``)
   on 2 simulated nodes x 2 ranks, ep=2, memory_efficient_init, against a
   single process: weights bit for bit after init, logits, loss and gradient norm;
4. in the same launch, for the families whose class keeps tensors in fp32 under bf16,
   the same in bf16 against one process in bf16 (``tests/multiproc/test_bf16.py``'s checks:
   weights and dtypes bit for bit, first-layer routing, bf16 tolerances).

Usage::

    python scripts/models_table.py                      # every family, writes docs/models.md + docs/models.json
    python scripts/models_table.py --families qwen3_moe,llama4_text --out /tmp/t.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

MAX_TINY_PARAMETERS = 2_000_000  # a config that did not shrink is not built (it could exhaust host memory)
TOLERANCE = 1e-5


def _is_multimodal(config_class) -> bool:
    return bool({"text_config", "vision_config"} & set(getattr(config_class, "sub_configs", None) or {}))


# Vision-language checkpoints with a hand-written tiny config (twinkle_strategy.testing.tiny_models), by model_type.
VISION_LANGUAGE_TINY = {"qwen3_5_moe": "qwen3_5_moe_vl", "qwen3_vl_moe": "qwen3_vl_moe"}


def moe_families() -> list[tuple[str, str]]:
    """(model_type, class name) of every MoE causal LM and image-text-to-text model; one model_type per class,
    the text one if there is one."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    by_class: dict[str, list[str]] = {}
    pairs = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()) + sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items())
    for model_type, class_name in pairs:
        cls = getattr(transformers, class_name, None)
        if cls is None or "self.experts" not in inspect.getsource(sys.modules[cls.__module__]):
            continue
        if model_type not in by_class.setdefault(class_name, []):
            by_class[class_name].append(model_type)
    chosen = []
    for class_name, model_types in by_class.items():
        text = [t for t in model_types if not _is_multimodal(CONFIG_MAPPING[t])]
        chosen.append(((text or model_types)[0], class_name))
    return sorted(chosen)


def _needed(contract, tensor_names: list[str]) -> str:
    """What serving the family took, in words."""
    from twinkle_strategy.moe.contracts import CallKind

    if contract.kind == CallKind.PRE_ROUTED:
        return ("pre-routed dispatch: the block repeats every token per expert, scaled by its score; only "
                "non-zero (token, expert) rows travel, padded per local expert for the module's forward")
    needs = []
    if contract.zero_experts:
        needs.append("zero-computation experts applied where the token is, never dispatched; gate_up_proj's "
                     "zero slots split evenly across EP ranks; forward given 2 choices per row")
    names = {n.rsplit(".", 1)[-1] for n in tensor_names}
    if "up_proj" in names and "gate_up_proj" not in names:
        needs.append("non-gated up_proj/down_proj cut per EP rank")
    if any(n.endswith("_bias") for n in names):
        needs.append("expert biases cut with their experts")
    return "; ".join(needs) or "the routed contract as is"


def inspect_family(model_type: str, class_name: str, root: Path) -> dict:
    """Build the tiny checkpoint and read what EP sees in it (no processes)."""
    import torch
    from torch import nn
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from twinkle_strategy.errors import ModelStructureError
    from twinkle_strategy.loading import model_class_for
    from twinkle_strategy.moe.discovery import find_moe_blocks
    from twinkle_strategy.testing.tiny_models import tiny_config

    row = dict(model_type=model_type, model_class=class_name)
    if _is_multimodal(CONFIG_MAPPING[model_type]) and model_type not in VISION_LANGUAGE_TINY:
        row.update(status="not run", detail="vision-language class: no tiny config of its vision tower yet (its "
                                             "language model has its own row if it has a text class)")
        return row
    try:
        config = tiny_config(VISION_LANGUAGE_TINY.get(model_type, model_type))
        model_class = model_class_for(config)
        with torch.device("meta"):
            size = sum(p.numel() for p in model_class.from_config(config).parameters())
        if size > MAX_TINY_PARAMETERS:
            raise ValueError(f"the shrunk config still has {size} parameters")
        torch.manual_seed(0)
        model = model_class.from_config(config)
        row["model_class"] = type(model).__name__
    except Exception as exc:  # noqa: BLE001 - reported in the table
        row.update(status="not run", detail=f"no tiny config: {type(exc).__name__}: {exc}")
        return row
    row["experts_classes"] = sorted({type(m.experts).__name__ for m in model.modules()
                                     if isinstance(getattr(m, "experts", None), nn.Module)})
    try:
        blocks = find_moe_blocks(model)
    except ModelStructureError as exc:
        row.update(status="refused", detail=str(exc))
        return row
    names = [t.fqn for b in blocks for t in b.tensors]
    shapes = {n.rsplit(".", 1)[-1]: tuple(model.get_parameter(n).shape) for n in names}
    row.update(contract=blocks[0].contract.kind.value, zero_experts=blocks[0].contract.zero_experts,
               tensors=shapes, needed=_needed(blocks[0].contract, names))
    row["fp32_kept"] = _fp32_kept(config, model_class)
    path = root / model_type
    model.save_pretrained(str(path), safe_serialization=True)
    row["checkpoint"] = str(path)
    return row


def _fp32_kept(config, model_class) -> bool:
    """Whether ``from_pretrained(dtype=torch.bfloat16)`` keeps some tensor of the family in fp32."""
    import torch

    from twinkle_strategy.loading import meta_skeleton

    tensors = meta_skeleton(config, torch.bfloat16, model_class=model_class).state_dict(keep_vars=True).values()
    return any(t.dtype == torch.float32 for t in tensors)


def run_matrix(families: list[str], bf16: list[str], root: Path, work: Path):
    """The worker's case results by family and rank, fp32 and bf16; relaunched after a family that stops a launch."""
    from multinode import launch

    results: dict[str, dict[int, dict]] = {}
    bf16_results: dict[str, dict[int, dict]] = {}
    pending, pending_bf16 = list(families), list(bf16)
    attempt = 0
    while pending or pending_bf16:
        attempt += 1
        out = work / f"launch{attempt}"
        run = launch("family_matrix.py", ["--ckpt-root", str(root), "--families", ",".join(pending),
                                          "--bf16", ",".join(pending_bf16), "--keep-going"],
                     out, nnodes=2, nproc_per_node=2, timeout=1800)
        for rank, data in run.rank_results().items():
            for key, recorded in (("cases", results), ("bf16_cases", bf16_results)):
                for case in data.get(key, []):
                    recorded.setdefault(case["family"], {})[rank] = case
        done = [f for f in pending if f in results] + [f for f in pending_bf16 if f in bf16_results]
        if not done:  # nothing recorded: blame the first family and go on without it
            first, recorded = (pending[0], results) if pending else (pending_bf16[0], bf16_results)
            recorded[first] = {-1: dict(family=first, error_type="launch failed", error=run.describe()[-2000:])}
        pending = [f for f in pending if f not in results]
        pending_bf16 = [f for f in pending_bf16 if f not in bf16_results]
        print(f"launch {attempt}: {len(done)} runs recorded, {len(pending) + len(pending_bf16)} to go "
              f"({run.seconds:.0f} s)", flush=True)
    return results, bf16_results


def bf16_verdict(row: dict, by_rank: dict[int, dict]) -> None:
    """The row's bf16 result, by tests/multiproc/test_bf16.py's own checks."""
    from test_bf16 import check_cases

    errors = [c for c in by_rank.values() if "error" in c]
    if errors:
        row["bf16"] = f"{errors[0]['error_type']}: {errors[0]['error']}"
        return
    try:
        check_cases({rank: {"cases": [case]} for rank, case in by_rank.items()}, [f"{row['model_type']}:full"])
    except AssertionError as exc:
        row["bf16"] = f"differs: {str(exc).splitlines()[0]}"
        return
    row["bf16"] = "matches" if len(by_rank) == 4 else f"only {len(by_rank)} ranks reported"


def verdict(row: dict, by_rank: dict[int, dict]) -> None:
    """Fill the row's status from every rank's case."""
    errors = [c for c in by_rank.values() if "error" in c]
    if errors:
        refused = [c for c in errors if c["error_type"] == "ModelStructureError"]
        row.update(status="refused" if refused else "error", detail=f"{errors[0]['error_type']}: {errors[0]['error']}")
        return
    cases = list(by_rank.values())
    logit = max(c["logit_diff"] for c in cases)
    norm = max(abs(c["norm"] - c["ref_norm"]) / c["ref_norm"] for c in cases)
    loss = max(abs(c["loss"] - c["ref_loss"]) for c in cases)
    exact = all(not c["state_mismatches"] and c["own_experts_ok"] for c in cases)
    ok = exact and logit <= TOLERANCE and norm <= TOLERANCE and loss <= TOLERANCE and len(cases) == 4
    row.update(status="matches" if ok else "differs", weights_exact=exact, logit_diff=logit, norm_rel_diff=norm,
               loss_diff=loss)
    if not all(c["train_mode"] for c in cases):
        row["needed"] += ("; compared in eval mode: its training-mode routing is random, so no two processes "
                          "agree in training mode")
    if not ok:
        row["detail"] = f"mismatched tensors: {sorted({k for c in cases for k in c['state_mismatches']})[:5]}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_markdown(rows: list[dict], path: Path, seconds: float) -> None:
    import torch
    import transformers

    served = [r for r in rows if r["status"] == "matches"]
    lines = [
        "# Supported MoE families",
        "",
        "Generated by `python scripts/models_table.py` (do not edit by hand): every class behind "
        f"`AutoModelForCausalLM` or `AutoModelForImageTextToText` in transformers {transformers.__version__} whose "
        "modeling code has an `experts` module (a vision-language checkpoint loads its own class, vision tower "
        f"included, and is trained on text here), run with torch {torch.__version__.split('+')[0]} on CPU (gloo) as 2 simulated nodes x 2 ranks, "
        "`ep_size=2`, `memory_efficient_init=True`, fp32, each against a single process of the same tiny "
        "checkpoint (the checks of `tests/multiproc/test_model_families.py`): the weights gathered right after init equal "
        "the single-process model's bit for bit and every rank holds its own experts; logits, loss and gradient "
        f"norm agree within {TOLERANCE:g} (gradient norm relative). Run took {seconds:.0f} s.",
        "",
        f"**{len(served)} of {len(rows)} families match.** Expert parallelism reads each experts module's call "
        "contract from its code (`twinkle_strategy/moe/contracts.py`): *routed* is "
        "`experts(hidden_states, top_k_index, top_k_weights)` with fused expert tensors (expert on dim 0) held by "
        "the module; *pre-routed* is Llama-4's `experts(routed_in)`. Anything else is refused at `wrap_model` "
        "with `ModelStructureError` on every rank (use `ep_size=1`, FSDP only, for those).",
        "",
        f"Families whose class keeps tensors in fp32 under bf16 ({len([r for r in rows if r.get('fp32_kept')])}; "
        "`_keep_in_fp32_modules_strict` or a parameter built in fp32) also run in bf16 in the same launch, "
        "loaded with `dtype=torch.bfloat16` and `mixed_precision='bf16'` against one process in bf16 (the "
        "checks of `tests/multiproc/test_bf16.py`: weights and dtypes bit for bit, fp32-kept parameters computing in fp32, "
        f"the first MoE layer's routing token for token, logits, loss and gradient norm within bf16 tolerances): "
        f"**{len([r for r in rows if r.get('bf16') == 'matches'])} match** (column bf16).",
        "",
        "| model_type | class | experts module | contract | expert tensors (tiny) | what it needed | result | "
        "max logit diff | grad norm rel. diff | bf16 (fp32-kept tensors) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tensors = ", ".join(f"`{k}` {list(v)}" for k, v in r.get("tensors", {}).items())
        contract = r.get("contract", "")
        if r.get("zero_experts"):
            contract += f" + {r['zero_experts']} zero-computation experts"
        # A refusal's own words up to the general advice every refusal ends with.
        detail = r.get("detail", "").split(" Expert parallelism serves")[0]
        result = r["status"] if r["status"] == "matches" else f"{r['status']}: {detail}"
        logit = f"{r['logit_diff']:.1e}" if "logit_diff" in r else ""
        norm = f"{r['norm_rel_diff']:.1e}" if "norm_rel_diff" in r else ""
        lines.append("| " + " | ".join(_cell(x) for x in (
            r["model_type"], r["model_class"], ", ".join(r.get("experts_classes", [])), contract, tensors,
            r.get("needed", ""), result, logit, norm, r.get("bf16", ""))) + " |")
    path.write_text("\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="", help="comma-separated model_types (default: every MoE family)")
    p.add_argument("--out", default=str(REPO / "docs" / "models.md"))
    args = p.parse_args()
    start = time.time()
    families = moe_families()
    if args.families:
        wanted = set(args.families.split(","))
        families = [f for f in families if f[0] in wanted]
    with tempfile.TemporaryDirectory(prefix="models_table_") as tmp:
        root, work = Path(tmp) / "ckpts", Path(tmp) / "runs"
        rows = [inspect_family(model_type, class_name, root) for model_type, class_name in families]
        runnable = [r["model_type"] for r in rows if "checkpoint" in r]
        print(f"{len(rows)} MoE families, {len(runnable)} to run", flush=True)
        bf16 = [r["model_type"] for r in rows if r.get("fp32_kept")]
        results, bf16_results = run_matrix(runnable, bf16, root, work) if runnable else ({}, {})
    for r in rows:
        if r["model_type"] in results:
            verdict(r, results[r["model_type"]])
        if r["model_type"] in bf16_results:
            bf16_verdict(r, bf16_results[r["model_type"]])
        r.pop("checkpoint", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_markdown(rows, out, time.time() - start)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")
    for r in rows:
        print(f"{r['model_type']:24s} {r['status']:10s} {r.get('detail', '')[:150]}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
