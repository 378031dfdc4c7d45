"""transformers.Trainer through NativeFSDPStrategy (``--mode strategy``), or plain on one process (``--mode plain``).

Both train a LoRA run (attention and experts), then a full-parameter run, on the same tiny
checkpoint and the same global batches, and write per rank: each run's per-step losses and
gradient norms, and rank 0 the logits on a probe batch of (LoRA) the saved adapter loaded with
plain PEFT on this process, (full) the saved checkpoint loaded with plain ``from_pretrained``.
A third run, full-parameter with the model's own load-balancing loss on (``output_router_logits``,
``router_aux_loss_coef``), takes one micro-batch of the whole global batch in the plain process, so
that its aux loss is the global batch's: the strategy's two micro-batches per rank must give the same.
Two runs on packed rows (transformers' ``DataCollatorWithFlattening``: one row per micro-batch, position ids
restarting at every example, no attention mask), against the plain process on the same packed rows with the KV
cache off (with a cache transformers does not look for packed sequences): a LoRA run, and a full-parameter run with
sequence_parallel_size=2 and the aux loss (its ranks exchange their rows and each computes a chunk of every row).
A sixth run (strategy only), the LoRA run again with ``async_save=True`` and ``save_total_limit=1``: its
writer pauses mid-file in checkpoint-2 (the package's test seam) until step 3 has begun; it reports when each
step began, when its writers wrote each file, what is left in its output directory, and (rank 0) which files of
its checkpoint-3 differ from the synchronous LoRA run's.
``--mode refuse``: first accelerate's ZeRO-3 in the environment, then sequence_parallel_size=2 with a
``compute_loss_func`` (it would shift a chunk's shifted labels again), then a DeepSpeed ZeRO-3 config in
TrainingArguments, next to the strategy; every rank must raise at once, each time.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

STEPS, SEQ, SAVE_STEP = 3, 16, 2
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
AUX_COEF = 0.5  # large, so that a locally counted aux loss would move the losses well past the tolerance
ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}


def dataset(global_batch: int, vocab: int):
    """Padded examples of different lengths: the loss is the mean over the global batch's label tokens."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(STEPS * global_batch):
        n = int(torch.randint(4, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (SEQ,), generator=g)
        mask = (torch.arange(SEQ) < n).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        labels[: n // 3] = -100  # a prompt part, not trained on
        rows.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return rows


def packed_dataset(global_batch: int, vocab: int):
    """Examples of 3 to 16 tokens, flattened per micro-batch by the collator (which masks each one's first label)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(STEPS * global_batch):
        n = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]})
    return rows


def training_args(output_dir: str, per_device: int, accumulation: int = 2, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1, save_steps=SAVE_STEP, save_strategy="steps",
        train_sampling_strategy="sequential", use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **extra)


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


def probe_logits(model, rows) -> list:
    batch = {k: torch.stack([r[k] for r in rows[:3]]) for k in ("input_ids", "attention_mask")}
    model.eval()
    with torch.no_grad():
        return model(**batch).logits.tolist()


def saved_logits(base: str, checkpoint: str, rows, lora: bool) -> list:
    """The saved checkpoint as a user reloads it: plain transformers (and plain PEFT), one process."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if lora:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), checkpoint)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return probe_logits(model, rows)


def run(mode: str, base: str, out: str, lora: bool, world: int, aux: bool = False, packed: bool = False, sp: int = 1,
        async_save: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.integrations.transformers import with_strategy

    name = "sp" if sp > 1 else "packed" if packed else "aux" if aux else "lora_async" if async_save else "lora" if lora else "full"
    micro = 2  # per rank and micro-batch; one process takes the whole global batch
    if aux and mode == "plain":  # one micro-batch of the global batch: the model's own aux loss is the global one
        args = training_args(os.path.join(out, name), micro * world * 2, accumulation=1)
    elif async_save:  # checkpoint-2 goes once checkpoint-3 is durable
        args = training_args(os.path.join(out, name), micro, save_total_limit=1)
    else:  # a sequence-parallel group shares its examples (world / sp data-parallel ranks): sp times the rows
        args = training_args(os.path.join(out, name), micro * sp if mode == "strategy" else micro * world)
    if mode == "strategy":
        strategy = NativeFSDPStrategy(ep_size=2, sequence_parallel_size=sp, memory_efficient_init=True,
                                      mixed_precision="no", device_type="cpu")
        model = strategy.from_pretrained(base, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        # The oracle without the strategy: packed rows need the cache off (the mixin turns it off itself).
        model.config.use_cache = not packed
    if aux:  # what a user sets to train with the model's load-balancing loss
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = model.router_aux_loss_coef = AUX_COEF
    if lora:
        torch.manual_seed(0)  # the same fresh adapter in both runs
        model = get_peft_model(model, LoraConfig(**LORA))
    rows = (packed_dataset if packed else dataset)(micro * world * 2, model.config.vocab_size)
    collator = {"data_collator": DataCollatorWithFlattening()} if packed else {}
    if mode == "strategy":
        trainer = with_strategy(Trainer)(model=model, args=args, train_dataset=rows, strategy=strategy,
                                         async_save=async_save, **collator)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=rows, **collator)
    if async_save:
        return {name: async_run(trainer, out)}
    trainer.train()
    result = history(trainer)
    if int(os.environ.get("RANK", "0")) == 0 and not (aux or packed):
        result["saved_logits"] = saved_logits(base, os.path.join(out, name, f"checkpoint-{SAVE_STEP}"), rows, lora)
    return {name: result}


def async_run(trainer, out: str) -> dict:
    """Train with the writer paused in checkpoint-2 until step 3 begins; what the test checks."""
    import time

    import torch.distributed as dist
    from save_writer_pause import pause_save_writer, release_once_every_rank_began_step_3
    from transformers import TrainerCallback

    pause = os.path.join(out, "pause")
    os.makedirs(pause, exist_ok=True)
    starts = {}

    class StepStarts(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            starts[state.global_step + 1] = time.time()
            if state.global_step + 1 == 3:
                release_once_every_rank_began_step_3(pause)

    trainer.add_callback(StepStarts())
    with pause_save_writer(f"checkpoint-{SAVE_STEP}", pause):
        trainer.train()
    saves = trainer.async_checkpoints.saves
    result = {**history(trainer), "step_starts": starts,
              "writes": {save.name: {name: vars(t) for name, t in save.write.file_times.items()}
                         for save in saves.finished}}
    dist.barrier()
    run_dir = os.path.join(out, "lora_async")
    result["left"] = sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint"))
    if int(os.environ["RANK"]) == 0:
        result["different"], result["compared"] = different_files(os.path.join(out, "lora", f"checkpoint-{STEPS}"),
                                                                  os.path.join(run_dir, f"checkpoint-{STEPS}"))
    return result


WALL_CLOCK = ("tokens_per_second", "tflops_per_device", "mfu", "train_runtime", "train_samples_per_second",
              "train_steps_per_second")


def different_files(sync: str, background: str) -> tuple[list[str], int]:
    """Files of checkpoint ``background`` that differ from ``sync``'s or exist in one only, and how many were
    compared. Byte for byte, except: trainer_state.json without its wall-clock log fields, training_args.bin
    without the fields the two runs set apart (output directory, save_total_limit)."""
    import filecmp
    import json

    names = {os.path.relpath(os.path.join(root, n), d) for d in (sync, background)
             for root, _, files in os.walk(d) for n in files}
    different = []
    for name in sorted(names):
        a, b = os.path.join(sync, name), os.path.join(background, name)
        if not (os.path.isfile(a) and os.path.isfile(b)):
            different.append(name)
        elif name == "trainer_state.json":
            with open(a) as f, open(b) as g:
                left, right = json.load(f), json.load(g)
            for state in (left, right):
                state["log_history"] = [{k: v for k, v in e.items() if k not in WALL_CLOCK} for e in state["log_history"]]
            if left != right:
                different.append(f"{name}: {json_differences(left, right)[:5]}")
        elif name == "training_args.bin":
            left, right = (torch.load(p, weights_only=False).to_dict() for p in (a, b))
            for args in (left, right):
                for key in ("output_dir", "logging_dir", "save_total_limit"):
                    args.pop(key, None)
            if left != right:
                different.append(f"{name}: {json_differences(left, right)[:5]}")
        elif not filecmp.cmp(a, b, shallow=False):
            different.append(name)
    return different, len(names)


def json_differences(a, b, where: str = "") -> list[str]:
    """Where two JSON values differ (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in json_differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in json_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def refuse(base: str, out: str):
    """Three refusals on every rank: accelerate's ZeRO-3 in the environment, by from_pretrained before the process
    group exists; sequence_parallel_size=2 with a compute_loss_func, by the trainer before wrapping; then a ZeRO-3
    config in TrainingArguments, by the trainer before any weight moves."""
    import torch.distributed as dist
    from transformers import Trainer

    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.errors import ConflictingShardingError, ParallelConfigError
    from twinkle_strategy.integrations.transformers import with_strategy

    strategy = NativeFSDPStrategy(ep_size=2, memory_efficient_init=True, mixed_precision="no", device_type="cpu")
    # What `accelerate launch --use_deepspeed --zero_stage 3` exports to every process.
    os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
    try:
        strategy.from_pretrained(base, dtype=torch.float32)
        env_error = None
    except ConflictingShardingError as exc:
        env_error = str(exc)
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"], os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"]
    worker_common.write_result({"env_error": env_error, "env_refused_before_process_group": not dist.is_initialized()})
    sp = NativeFSDPStrategy(ep_size=2, sequence_parallel_size=2, memory_efficient_init=True, mixed_precision="no",
                            device_type="cpu")
    model = sp.from_pretrained(base, dtype=torch.float32)
    try:
        with_strategy(Trainer)(model=model, args=training_args(out, 2), train_dataset=[], strategy=sp,
                               compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss)
        worker_common.write_result({"sp_refusal": None})
    except ParallelConfigError as exc:
        worker_common.write_result({"sp_refusal": str(exc), "sp_init_report": sp.init_report is not None})
    model = strategy.from_pretrained(base, dtype=torch.float32)
    args = training_args(out, 2)
    # What TrainingArguments(deepspeed=...) keeps where DeepSpeed is installed (this machine has no deepspeed
    # package, and transformers refuses to build the arguments without it).
    args.deepspeed = ZERO3
    worker_common.write_result({"init_report_before": strategy.init_report is not None})
    try:
        with_strategy(Trainer)(model=model, args=args, train_dataset=[], strategy=strategy)
    except ConflictingShardingError:
        worker_common.write_result({"refused_at": time.time()})  # the test measures how soon every rank is gone
        raise


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["strategy", "plain", "refuse"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=4)
    a = p.parse_args()
    if a.mode == "refuse":
        return refuse(a.model, a.out)
    result = {**run(a.mode, a.model, a.out, lora=True, world=a.world),
              **run(a.mode, a.model, a.out, lora=False, world=a.world),
              **run(a.mode, a.model, a.out, lora=False, world=a.world, aux=True),
              **run(a.mode, a.model, a.out, lora=True, world=a.world, packed=True),
              **run(a.mode, a.model, a.out, lora=False, world=a.world, aux=True, packed=True, sp=2)}
    if a.mode == "strategy":
        result.update(run(a.mode, a.model, a.out, lora=True, world=a.world, async_save=True))
    return result


if __name__ == "__main__":
    worker_common.run(main)
