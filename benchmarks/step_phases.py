"""The training step at world size 1, phase by phase: this package's step against plain transformers (+ PEFT).

    python benchmarks/step_phases.py --repeat 3 --steps 8    # CPU, the reported run: a small Qwen3-MoE (~3 min)
    python benchmarks/step_phases.py --quick                 # smoke run
    # a GPU: Qwen3-30B-A3B's layer shapes, 4 layers (3.11 B parameters), the issue's batches
    python benchmarks/step_phases.py --device cuda --shape qwen3-30b-a3b --layers 4 --model /tmp/moe4 \
        --seq 4096 --batch 2 --steps 7 --tuners lora --name step_phases_cuda_lora
    python benchmarks/step_phases.py --device cuda --shape qwen3-30b-a3b --layers 4 --model /tmp/moe4 \
        --seq 4096 --batch 1 --steps 7 --tuners full --name step_phases_cuda_full

One process, one rank (gloo on CPU, NCCL on a GPU). Every arm trains the same model (one checkpoint of random
weights, built once, in ``--dtype``), on the same rows of random token ids (the rows twinkle-sft's sampler picks for
each step), with the same AdamW settings (lr 1e-4, no weight decay) and gradients clipped to 1.0; the tuners are
LoRA r=16 (alpha 32) on q/k/v/o and the experts (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), and full
parameters. The arms:

  plain_foreach     transformers' model (+ PEFT's LoRA), torch.optim.AdamW as a user writes it (foreach: torch's
                    default), torch.nn.utils.clip_grad_norm_
  plain_fused       the same with AdamW(fused=True): what HF Trainer's default (adamw_torch_fused) runs
  strategy_foreach  NativeFSDPStrategy.from_pretrained, PEFT, strategy.wrap_model(model, optimizer) and
                    strategy.clip_grad_norm_ (the bare loop of the README's lower-level API), foreach AdamW
  strategy_fused    the same with fused AdamW (twinkle-sft's default)
  trainer           twinkle-sft's own step, Trainer.training_step (twinkle_strategy.train.trainer): the step core's
                    forward and backward, the loss all-reduce, clipping, fused AdamW and the scheduler (constant)

Each step is timed with the device synchronized around every phase (forward; backward; clip; optimizer step with
zero_grad) and as a whole; the trainer's step only as a whole. On CPU the arms take turns step by step, every arm's
model built at once, so that other jobs' load falls on all of them alike (``--no-interleave``: one arm after the
other, each freed first, as on a GPU, where one 3 B model's full-parameter training is what the memory holds).
``--repeat`` runs every arm again (fresh models, the first arm changing) and pools the steps. Reported: the median over the timed steps (after ``--warmup`` steps that
are not timed in each round), tokens/s and the ratio to the plain arms, TFLOPS and MFU from the package's
FLOPs model (twinkle_strategy.moe.flops: what twinkle-sft logs as mfu; MFU only where the device's peak is known, or
given with ``--peak-tflops``), peak device memory (GPU), and the first step's loss (every arm starts from the same
weights and adapter, so it is the same up to the dtype's rounding).

A CPU shows what the Python around the step costs and the optimizer's and clipping's arithmetic; it cannot show a
GPU's kernel launches, host syncs, casts or memory traffic, which is where these arms differ most: the figures that
decide are the GPU command's.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import gc
import json
import math
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from bench_io import command_line, write_results  # noqa: E402

PHASES = ("forward", "backward", "clip", "optimizer")
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
SEED = 42


class Tuner(str, enum.Enum):
    LORA = "lora"
    FULL = "full"


class Loop(str, enum.Enum):
    """Who runs the step."""

    PLAIN = "plain"  # transformers (+ PEFT) and torch, no twinkle_strategy
    STRATEGY = "strategy"  # the bare strategy.wrap_model loop
    TRAINER = "trainer"  # twinkle-sft's Trainer.training_step


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    loop: Loop
    fused: bool  # torch.optim.AdamW(fused=True), else foreach
    what: str


ARMS = {arm.name: arm for arm in (
    Arm("plain_foreach", Loop.PLAIN, False, "transformers + PEFT, torch AdamW's default (foreach)"),
    Arm("plain_fused", Loop.PLAIN, True, "transformers + PEFT, AdamW(fused=True): HF Trainer's default"),
    Arm("strategy_foreach", Loop.STRATEGY, False, "strategy.wrap_model loop, foreach AdamW"),
    Arm("strategy_fused", Loop.STRATEGY, True, "strategy.wrap_model loop, fused AdamW (twinkle-sft's default)"),
    Arm("trainer", Loop.TRAINER, True, "twinkle-sft's Trainer.training_step, fused AdamW (its collation, loss "
                                       "all-reduce and grad-norm read included)"),
)}
BASELINES = ("plain_foreach", "plain_fused")  # the ratio columns


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Qwen3-MoE's sizes (every layer MoE)."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int


SHAPES = {
    # A CPU's: small enough for a few minutes on two shared cores, with every part of the real model.
    "small": ModelShape(vocab_size=8192, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
                        num_hidden_layers=2),
    # Qwen3-30B-A3B's layers (../shared/gpu/make_moe.py; the GPU figures: 4 layers, 3.11 B parameters).
    "qwen3-30b-a3b": ModelShape(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
                                num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                num_experts_per_tok=8, num_hidden_layers=48),
}


@dataclasses.dataclass
class ArmResult:
    arm: str
    tuner: str
    phases_ms: dict[str, float] | None  # medians; None for the trainer (timed as a whole)
    total_ms: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None
    peak_gib: float | None
    first_loss: float
    flops_per_token: float
    steps_ms: list[float]  # every timed step's total


@dataclasses.dataclass(frozen=True)
class Workload:
    """What every arm trains on: the checkpoint, the rows of each step, the device and dtype."""

    model_path: str
    rows: list[list[int]]  # the dataset: token ids
    order: list[list[int]]  # the dataset rows of each step (twinkle-sft's sampler)
    device: str
    dtype_name: str
    mixed_precision: str  # the strategy's and the trainer's
    seq: int
    batch: int
    warmup: int  # steps not timed, each round
    peak_tflops: float | None

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def batch_of(self, step: int) -> dict:
        """Step ``step``'s batch as twinkle-sft's collator makes it (no padding: every row is ``seq`` long)."""
        from twinkle_strategy.train.data import DataCollatorForSFT

        batch = DataCollatorForSFT(pad_token_id=0)([self.example(i) for i in self.order[step]])
        return {key: value.to(self.device) for key, value in batch.items()}

    def example(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


# ---------------------------------------------------------------------------------------------------- set-up
def build_checkpoint(path: str, shape: ModelShape, *, device: str, dtype_name: str) -> None:
    """A Qwen3-MoE of ``shape`` with random weights (seed 0), saved at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**dataclasses.asdict(shape),
                            intermediate_size=3 * shape.hidden_size, norm_topk_prob=True, decoder_sparse_step=1,
                            max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    model.save_pretrained(path, max_shard_size="4GB")
    del model


def parameter_count(path: str) -> int:
    """The parameters of the checkpoint's model (built on the meta device: no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


def init_world_of_one(device: str) -> None:
    """This process as rank 0 of a world of one, as torchrun would start it (the strategy reads the same variables)."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")


def with_lora(model):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)  # the same fresh adapter in every arm
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGET_MODULES,
                                            target_parameters=LORA_TARGET_PARAMETERS))


def adamw(model, *, fused: bool):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=0.0, fused=fused, foreach=not fused)


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- the arms
@dataclasses.dataclass
class StepTimes:
    """One step of one arm: its phases' seconds (None: timed only as a whole), its total, its loss."""

    phases: dict[str, float] | None
    total: float
    loss: torch.Tensor | float  # a tensor until the report (no sync inside the step)


@dataclasses.dataclass
class Runner:
    """An arm ready to step: ``step(index)`` runs and times training step ``index``; ``close()`` frees it."""

    step: Callable[[int], StepTimes]
    flops_model: object  # twinkle_strategy.moe.flops.FlopsModel of the arm's model (adapters included)
    close: Callable[[], None] = lambda: None


@dataclasses.dataclass
class Measured:
    """What an arm's timed steps gave, over every round: per phase and in total, seconds; the first step's loss."""

    flops_model: object
    phases: dict[str, list[float]] | None = None
    totals: list[float] = dataclasses.field(default_factory=list)
    first_loss: float = float("nan")
    peak_gib: float | None = None  # GPU, one arm at a time: torch.cuda.max_memory_allocated over its steps

    def add(self, index: int, times: StepTimes, *, warmup: int) -> None:
        if index == 0 and math.isnan(self.first_loss):
            self.first_loss = float(times.loss)
        if index < warmup:
            return
        if times.phases is not None:
            self.phases = self.phases or {name: [] for name in PHASES}
            for name, seconds in times.phases.items():
                self.phases[name].append(seconds)
        self.totals.append(times.total)


def loop_runner(arm: Arm, tuner: Tuner, work: Workload) -> Runner:
    """The plain and the strategy arms: forward, backward, clip, optimizer step, each timed apart."""
    import torch
    from transformers import AutoModelForCausalLM

    from twinkle_strategy.moe.flops import FlopsModel

    if arm.loop is Loop.PLAIN:
        placement = {"device_map": work.device} if work.device != "cpu" else {}  # straight to the GPU, as users load
        model = AutoModelForCausalLM.from_pretrained(work.model_path, dtype=work.dtype, **placement)
        model = with_lora(model) if tuner is Tuner.LORA else model
        flops_model = FlopsModel.of(model)
        optimizer = adamw(model, fused=arm.fused)
        params = [p for p in model.parameters() if p.requires_grad]

        def clip():
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
    else:
        from twinkle_strategy import NativeFSDPStrategy

        strategy = NativeFSDPStrategy(device_type=work.device, mixed_precision=work.mixed_precision)
        model = strategy.from_pretrained(work.model_path, dtype=work.dtype)
        model = with_lora(model) if tuner is Tuner.LORA else model
        flops_model = FlopsModel.of(model)
        model, optimizer = strategy.wrap_model(model, adamw(model, fused=arm.fused))

        def clip():
            strategy.clip_grad_norm_(model, MAX_GRAD_NORM)

    model.train()

    def step(index: int) -> StepTimes:
        batch = work.batch_of(index)
        synchronize(work.device)
        marks = [time.perf_counter()]
        loss = model(**batch).loss
        synchronize(work.device)
        marks.append(time.perf_counter())
        loss.backward()
        synchronize(work.device)
        marks.append(time.perf_counter())
        clip()
        synchronize(work.device)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(work.device)
        marks.append(time.perf_counter())
        phases = {name: end - begin for name, begin, end in zip(PHASES, marks[:-1], marks[1:], strict=True)}
        return StepTimes(phases, marks[-1] - marks[0], loss.detach())

    return Runner(step=step, flops_model=flops_model)


def trainer_runner(arm: Arm, tuner: Tuner, work: Workload) -> Runner:
    """twinkle-sft's step: Trainer.training_step on the same rows (its dataset and sampler), timed as a whole."""
    from twinkle_strategy import NativeFSDPStrategy
    from twinkle_strategy.moe.flops import FlopsModel
    from twinkle_strategy.train.arguments import OptimizerName, TrainingArguments
    from twinkle_strategy.train.data import DataCollatorForSFT, SFTDataset
    from twinkle_strategy.train.trainer import Trainer

    strategy = NativeFSDPStrategy(device_type=work.device, mixed_precision=work.mixed_precision)
    model = strategy.from_pretrained(work.model_path, dtype=work.dtype)
    model = with_lora(model) if tuner is Tuner.LORA else model
    flops_model = FlopsModel.of(model)
    optim = OptimizerName.ADAMW_TORCH_FUSED if arm.fused else OptimizerName.ADAMW_TORCH
    output_dir = tempfile.mkdtemp(prefix="step_phases_trainer_")  # its run directory (args.json; no checkpoint)
    args = TrainingArguments(output_dir=output_dir, max_steps=len(work.order), per_device_train_batch_size=work.batch,
                             learning_rate=LEARNING_RATE, weight_decay=0.0, optim=optim.value,
                             lr_scheduler_type="constant", max_grad_norm=MAX_GRAD_NORM, seed=SEED)
    dataset = SFTDataset([work.example(i) for i in range(len(work.rows))], max_length=work.seq)
    trainer = Trainer(model=model, strategy=strategy, args=args, train_dataset=dataset,
                      data_collator=DataCollatorForSFT(pad_token_id=0), print_summary=False)
    trainer.setup()
    assert [trainer.sampler.rows(s) for s in range(args.max_steps)] == work.order  # the other arms' rows

    def step(index: int) -> StepTimes:
        synchronize(work.device)
        began = time.perf_counter()
        result = trainer.training_step(index)
        synchronize(work.device)
        return StepTimes(None, time.perf_counter() - began, result["loss"])

    return Runner(step=step, flops_model=flops_model, close=lambda: shutil.rmtree(output_dir, ignore_errors=True))


def build_runner(arm: Arm, tuner: Tuner, work: Workload) -> Runner:
    return (trainer_runner if arm.loop is Loop.TRAINER else loop_runner)(arm, tuner, work)


def free_device_memory(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_round(arms: list[Arm], tuner: Tuner, work: Workload, measured: dict[str, Measured], *,
              interleave: bool) -> None:
    """One round of every arm, added to ``measured``. Interleaved: every arm's model at once, the arms taking turns
    step by step (their order rotating), so that a load on the machine falls on all of them alike; otherwise one arm
    after the other, each freed before the next (a GPU's memory holds one 3 B model's full-parameter training)."""
    import torch

    steps = range(len(work.order))
    if interleave:
        runners = {arm.name: build_runner(arm, tuner, work) for arm in arms}
        for index in steps:
            turn = arms[index % len(arms):] + arms[:index % len(arms)]
            for arm in turn:
                times = runners[arm.name].step(index)
                measured.setdefault(arm.name, Measured(runners[arm.name].flops_model)).add(
                    index, times, warmup=work.warmup)
        for runner in runners.values():
            runner.close()
        del runners
        free_device_memory(work.device)
        return
    for arm in arms:
        if work.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        runner = build_runner(arm, tuner, work)
        record = measured.setdefault(arm.name, Measured(runner.flops_model))
        for index in steps:
            record.add(index, runner.step(index), warmup=work.warmup)
        if work.device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**30
            record.peak_gib = max(peak, record.peak_gib or 0.0)
        runner.close()
        del runner
        free_device_memory(work.device)


def summarize(arm: Arm, tuner: Tuner, measured: Measured, work: Workload) -> ArmResult:
    """The arm's figures: medians over every timed step of every round."""
    import torch

    from twinkle_strategy.moe.flops import device_peak_tflops, throughput

    total = statistics.median(measured.totals)
    peak_tflops = work.peak_tflops or device_peak_tflops(torch.device(work.device))
    fields = throughput(measured.flops_model, tokens=work.batch * work.seq, seq_len=work.seq, seconds=total,
                        world_size=1, peak_tflops=peak_tflops)
    phases = None if measured.phases is None else \
        {name: 1e3 * statistics.median(seconds) for name, seconds in measured.phases.items()}
    return ArmResult(arm=arm.name, tuner=tuner.value, phases_ms=phases, total_ms=1e3 * total,
                     tokens_per_s=fields["tokens_per_second"], tflops_per_device=fields["tflops_per_device"],
                     mfu=fields.get("mfu"), peak_gib=measured.peak_gib, first_loss=measured.first_loss,
                     flops_per_token=measured.flops_model.per_token(work.seq),
                     steps_ms=[1e3 * t for t in measured.totals])


# ---------------------------------------------------------------------------------------------------- report
def render(results: list[ArmResult], header: str) -> str:
    lines = [header, ""]
    for tuner in dict.fromkeys(r.tuner for r in results):
        rows = [r for r in results if r.tuner == tuner]
        base = {r.arm: r.tokens_per_s for r in rows if r.arm in BASELINES}
        lines += [f"**{tuner}** (milliseconds, medians of the timed steps; FLOPs per token "
                  f"{rows[0].flops_per_token:.4g})", "",
                  "| arm | forward | backward | clip | optimizer | total | tokens/s | vs plain_foreach "
                  "| vs plain_fused | TFLOPS | MFU | peak GiB | first loss |", "|" + "---|" * 13]
        for r in rows:
            phases = [f"{r.phases_ms[k]:.1f}" if r.phases_ms else "-" for k in PHASES]
            ratios = [f"{r.tokens_per_s / base[b]:.2f}x" if b in base else "-" for b in BASELINES]
            mfu = f"{r.mfu:.3f}" if r.mfu is not None else "-"
            peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "-"
            lines.append(f"| {r.arm} | {' | '.join(phases)} | {r.total_ms:.1f} | {r.tokens_per_s:,.0f} | "
                         f"{' | '.join(ratios)} | {r.tflops_per_device:.3g} | {mfu} | {peak} | {r.first_loss:.4f} |")
        lines.append("")
    lines += ["Arms: " + "; ".join(f"`{a.name}`: {a.what}" for a in ARMS.values() if a.name in
                                   {r.arm for r in results}) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES), help="the model's sizes")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    parser.add_argument("--model", default=None, help="a Qwen3-MoE checkpoint's directory: used if it holds one, "
                                                      "else built there from --shape and kept (default: built in a "
                                                      "temporary directory)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mixed-precision", default="bf16", choices=["bf16", "no"],
                        help="the strategy's and the trainer's (twinkle-sft's default: bf16)")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row")
    parser.add_argument("--batch", type=int, default=2, help="rows per step")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (the median is reported)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every arm (fresh models), steps pooled")
    parser.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                        help="every arm's model at once, the arms taking turns step by step (default: on CPU, "
                             "where other jobs' load comes and goes; off on a GPU, one model in memory at a time)")
    parser.add_argument("--tuners", nargs="+", default=[t.value for t in Tuner], choices=[t.value for t in Tuner])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (default: the "
                                                                        "package's table, which knows H100/H200)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 warm-up and 2 timed steps")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default=None, help="the results' file name (default: step_phases on CPU, "
                                                     "step_phases_cuda on a GPU)")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.batch, args.warmup, args.steps = 64, 1, 1, 2
    import peft
    import torch
    import transformers

    load_before = os.getloadavg()[0]  # the machine's load (other jobs share a CPU): said beside the figures
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # the per-arm load bars and notices would bury the table
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = dataclasses.replace(shape, num_hidden_layers=args.layers)
    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model or os.path.join(scratch, "model")
        built = not os.path.exists(os.path.join(model_path, "config.json"))
        if built:
            build_checkpoint(model_path, shape, device=args.device, dtype_name=args.dtype)
            free_device_memory(args.device)  # the built model's memory, before the first arm
        parameters = parameter_count(model_path)
        from transformers import AutoConfig

        from twinkle_strategy.train.data import StepSampler

        vocab = AutoConfig.from_pretrained(model_path).vocab_size
        generator = torch.Generator().manual_seed(SEED)
        steps = args.warmup + args.steps
        rows = torch.randint(0, vocab, (steps * args.batch, args.seq), generator=generator).tolist()
        sampler = StepSampler(len(rows), per_step=args.batch, seed=SEED)
        work = Workload(model_path=model_path, rows=rows, order=[sampler.rows(s) for s in range(steps)],
                        device=args.device, dtype_name=args.dtype, mixed_precision=args.mixed_precision,
                        seq=args.seq, batch=args.batch, warmup=args.warmup, peak_tflops=args.peak_tflops)
        init_world_of_one(args.device)
        arms = [ARMS[name] for name in args.arms]
        interleave = args.interleave if args.interleave is not None else args.device == "cpu"
        results = []
        for tuner in (Tuner(t) for t in args.tuners):
            measured: dict[str, Measured] = {}
            for index in range(args.repeat):
                rotated = arms[index % len(arms):] + arms[:index % len(arms)]  # who goes first changes
                run_round(rotated, tuner, work, measured, interleave=interleave)
                print(json.dumps({"round": index, "tuner": tuner.value, "total_ms": {
                    name: round(1e3 * statistics.median(m.totals), 2) for name, m in measured.items()}}), flush=True)
            results += [summarize(arm, tuner, measured[arm.name], work) for arm in arms]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU, {args.threads} thread(s), load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after"
    model_text = (f"Qwen3-MoE `{args.shape}` shape, {shape.num_hidden_layers} layers, {shape.num_experts} experts "
                  f"top-{shape.num_experts_per_tok}, hidden {shape.hidden_size}" if built else f"`{args.model}`")
    model_text += f", {parameters / 1e9:.3g} B parameters"
    header = (f"Command: `{command_line('step_phases.py')}`\n\n{device_name}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}, peft {peft.__version__}; {model_text}; {args.dtype}, strategy mixed "
              f"precision {args.mixed_precision}; {args.batch} x {args.seq} tokens a step; medians of {args.steps} "
              f"steps after {args.warmup} warm-up steps in each of {args.repeat} round(s); TFLOPS and MFU from "
              f"twinkle_strategy.moe.flops (6 x active parameters + attention, per token; what twinkle-sft logs).")
    text = render(results, header)
    print(text)
    if not args.quick:
        name = args.name or ("step_phases" if args.device == "cpu" else f"step_phases_{args.device}")
        write_results(args.out, name, text=text, payload={"command": command_line("step_phases.py"),
                                                          "args": vars(args), "shape": dataclasses.asdict(shape),
                                                          "parameters": parameters, "torch": torch.__version__,
                                                          "device": device_name,
                                                          "results": [dataclasses.asdict(r) for r in results]})
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
