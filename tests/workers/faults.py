"""Real faults in real processes: a rank killed mid-init or mid-step, a kill or a full disk mid-save.

Each scenario injects its fault by wrapping one package function in this
worker process only (the package itself has no test hooks).
"""

import argparse
import os
import resource
import signal
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import worker_common  # noqa: E402

from twinkle_strategy import NativeFSDPStrategy  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_source_mid_transfer(args):
    from twinkle_strategy.init import transport

    sent = {"n": 0}
    original = transport.send_bucket

    def send_then_die(message, peer):
        sent["n"] += 1
        if RANK == 2 and sent["n"] == 3:  # node 1's source, after two buckets went out
            die()
        return original(message, peer)

    transport.send_bucket = send_then_die
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                  init_bucket_mb=2048 / 2**20, timeout_s=args.timeout)
    strategy.wrap_model(strategy.from_pretrained(args.model))


def corrupt_in_transit(args):
    from twinkle_strategy.init import streams

    original = streams.StreamWriter.write

    def write_flipping_one_byte(self, chunk):
        if RANK == 3 and not getattr(self, "_flipped", False) and chunk.numel() > 100:
            chunk = chunk.clone()
            chunk[100] ^= 0xFF
            self._flipped = True
        return original(self, chunk)

    streams.StreamWriter.write = write_flipping_one_byte
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True, verify_init=True,
                                  init_bucket_mb=4096 / 2**20, timeout_s=args.timeout)
    strategy.wrap_model(strategy.from_pretrained(args.model))


def _trainer(args, max_steps, save_steps, output_dir, resume=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
    from twinkle_strategy.train.trainer import Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = SFTDataset.from_jsonl(args.dataset, tokenizer, max_length=48)
    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                  timeout_s=args.timeout)
    model = strategy.from_pretrained(args.model)
    if not args.full:  # LoRA; with --full every weight trains (and a save writes the whole model in parallel)
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                 target_parameters=["mlp.experts.gate_up_proj"]))
    train_args = TrainingArguments(output_dir=output_dir, add_version=False, max_steps=max_steps,
                                   save_steps=save_steps, per_device_train_batch_size=2, logging_steps=1,
                                   learning_rate=1e-3, resume_from_checkpoint=resume)
    return Trainer(model=model, strategy=strategy, args=train_args, train_dataset=dataset,
                   data_collator=DataCollatorForSFT(tokenizer.pad_token_id))


def kill_rank_in_training_step(args):
    from twinkle_strategy.train.trainer import Trainer

    original = Trainer.training_step

    def step_then_die(self, step):
        if RANK == 3 and step == 2:
            die()
        return original(self, step)

    Trainer.training_step = step_then_die
    _trainer(args, 5, 0, args.output_dir).train()


def kill_during_save(args):
    from twinkle_strategy.checkpoint import training, writing

    original_save, original_write = training.torch.save, writing.ParallelFileWriter.write

    def save_then_die(obj, path, *a, **k):
        if RANK == 1 and "checkpoint-4.tmp" in str(path):
            die()
        return original_save(obj, path, *a, **k)

    def write_then_die(self, key, tensor, rows=None):
        # Rank 1 dies in the middle of writing its rows into the checkpoint's files.
        if RANK == 1 and "checkpoint-4.tmp" in self.directory and self.bytes_written > 0:
            die()
        return original_write(self, key, tensor, rows)

    training.torch.save = save_then_die
    writing.ParallelFileWriter.write = write_then_die
    _trainer(args, 6, 2, args.output_dir).train()


def kill_during_save_pretrained(args):
    """save_pretrained into a new directory, again into it (now holding a file of the user's too),
    then into another new directory, during which rank 1 dies."""
    import hashlib

    from twinkle_strategy.checkpoint import writing

    strategy = NativeFSDPStrategy(ep_size=2, mixed_precision="no", memory_efficient_init=True,
                                  timeout_s=args.timeout)
    model, _ = strategy.wrap_model(strategy.from_pretrained(args.model))
    target = os.path.join(args.output_dir, "model")

    def digests():
        return {name: hashlib.sha256(open(os.path.join(target, name), "rb").read()).hexdigest()
                for name in sorted(os.listdir(target))}

    strategy.save_pretrained(model, target)
    if RANK == 0:
        first = digests()
        with open(os.path.join(target, "notes.txt"), "w") as f:
            f.write("the user's own file")
    strategy.save_pretrained(model, target)
    if RANK == 0:
        worker_common.write_result({"first_save": first, "second_save": digests()})
    original_write = writing.ParallelFileWriter.write

    def write_then_die(self, key, tensor, rows=None):
        if RANK == 1 and self.bytes_written > 0:  # in the middle of its rows
            die()
        return original_write(self, key, tensor, rows)

    writing.ParallelFileWriter.write = write_then_die
    strategy.save_pretrained(model, os.path.join(args.output_dir, "fresh"))


def disk_full_during_save(args):
    from twinkle_strategy.train.trainer import Trainer

    original = Trainer.save

    def save_with_tiny_disk(self, global_step):
        if RANK == 0 and global_step == 4:
            # A real write failure from the kernel: files may not grow past 16 KiB any more
            # (the adapter is bigger; the small result file this worker writes is not).
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, resource.RLIM_INFINITY))
        return original(self, global_step)

    Trainer.save = save_with_tiny_disk
    _trainer(args, 6, 2, args.output_dir).train()


def fail_trainer_state_writes(args):
    """Rank 1 cannot write its rows of the optimizer state (first save), then of the trainable weights (second).

    Expert LoRA with ep=2: ``lora_B`` of the experts is gathered to be written, so a rank that stopped
    calling the collective writes after its failure would leave its peers in that gather."""
    import errno
    import time

    from twinkle_strategy.checkpoint import writing

    original = writing.ParallelFileWriter.write
    failing = {"prefix": None}

    def write_or_fail(self, key, tensor, rows=None):
        if RANK == 1 and self.plan.tensors[key].file.startswith(failing["prefix"] or "-"):
            raise OSError(errno.EIO, f"injected I/O error writing '{key}'")
        return original(self, key, tensor, rows)

    writing.ParallelFileWriter.write = write_or_fail
    trainer = _trainer(args, 1, 0, args.output_dir)
    trainer.train()  # one step, then a good save: the optimizer has state
    saves = {}
    for step, prefix in ((2, "optimizer"), (3, "trainable")):
        failing["prefix"] = prefix
        start = time.monotonic()
        try:
            trainer.save(step)
            saves[prefix] = {"error_type": None}
        except Exception as exc:  # noqa: BLE001 - the test reads it
            saves[prefix] = {"error_type": type(exc).__name__, "error": str(exc)}
        saves[prefix]["seconds"] = time.monotonic() - start
    return {"saves": saves}


def resume(args):
    trainer = _trainer(args, 6, 2, args.output_dir, resume=args.output_dir)
    history = trainer.train()
    return {"start_step": trainer.start_step, "steps": [e["global_step/max_steps"] for e in history]}


SCENARIOS = {f.__name__: f for f in (kill_source_mid_transfer, corrupt_in_transit, kill_rank_in_training_step,
                                     kill_during_save, kill_during_save_pretrained, disk_full_during_save,
                                     fail_trainer_state_writes,
                                     resume)}


# What the scenarios patch, restored between the scenarios of one --batch run.
def _patched_attributes():
    from twinkle_strategy.checkpoint import writing
    from twinkle_strategy.init import streams
    from twinkle_strategy.train.trainer import Trainer

    return [(Trainer, "save"), (writing.ParallelFileWriter, "write"), (streams.StreamWriter, "write")]


def batch(args):
    """The faults no process dies of, in one launch: ``--batch name[:full],...``, each scenario with its own
    output directory (``--output-dir``/KEY, KEY the entry with ':' as '_'); each error is recorded under
    ``scenarios`` and the last entry's is left uncaught, so every rank ends with it."""
    *caught, last = args.batch.split(",")
    scenarios = {}

    def scenario_args(entry):
        mode = entry.partition(":")[2]
        return argparse.Namespace(**{**vars(args), "full": mode == "full",
                                     "output_dir": os.path.join(args.output_dir, entry.replace(":", "_"))})

    for entry in caught:
        key = entry.replace(":", "_")
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr in _patched_attributes()]
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        try:
            scenarios[key] = {"error_type": None, "result": SCENARIOS[entry.partition(":")[0]](scenario_args(entry))}
        except Exception as exc:  # noqa: BLE001 - the test reads it
            scenarios[key] = {"error_type": type(exc).__name__, "error": str(exc)}
        finally:
            for owner, attr, value in saved:
                setattr(owner, attr, value)
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        worker_common.write_result({"scenarios": scenarios})
    return SCENARIOS[last.partition(":")[0]](scenario_args(last))  # its error ends every rank


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=sorted(SCENARIOS))
    p.add_argument("--batch", help="name[:full],... (see batch)")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset")
    p.add_argument("--output-dir")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--full", action="store_true", help="full-parameter training instead of LoRA")
    args = p.parse_args()
    return batch(args) if args.batch else SCENARIOS[args.scenario](args)


if __name__ == "__main__":
    worker_common.run(main)
