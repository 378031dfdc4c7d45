"""``TrainingArguments``: the trainer's options, named as transformers' and swift's (each is also a twinkle-sft flag)."""

from __future__ import annotations

import dataclasses
import enum

from twinkle_strategy.train.errors import RecipeError


class OptimizerName(str, enum.Enum):
    """``optim``: which of torch's AdamW implementations steps the parameters, named as transformers names them
    (``transformers.training_args.OptimizerNames``). Both keep the same state (``step``, ``exp_avg``,
    ``exp_avg_sq``), so a run saved with one resumes with the other."""

    ADAMW_TORCH_FUSED = "adamw_torch_fused"  # one kernel per device and dtype: HF Trainer's and torchtitan's default
    ADAMW_TORCH = "adamw_torch"  # torch's multi-tensor (foreach) ops

    def torch_options(self) -> dict[str, bool]:
        """The keyword arguments of ``torch.optim.AdamW`` that choose this implementation."""
        if self is OptimizerName.ADAMW_TORCH_FUSED:
            return {"fused": True, "foreach": False}
        return {"fused": False, "foreach": True}


OPTIMIZERS = tuple(name.value for name in OptimizerName)


def _option(default, help: str, **kwargs):  # noqa: A002 - the name argparse and transformers use
    """A field with its one-line help (``--help`` shows it under the flag of the same name)."""
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = _option("output", "directory of the run directories")
    add_version: bool = _option(True, "write into output_dir/v{N}-{YYYYMMDD-HHMMSS}, like swift; false: into "
                                      "output_dir itself")
    num_train_epochs: float = _option(1.0, "passes over the dataset (when max_steps is not > 0)")
    max_steps: int = _option(-1, "optimizer steps to train; > 0 overrides num_train_epochs")
    per_device_train_batch_size: int = _option(1, "examples per rank and micro-batch")
    gradient_accumulation_steps: int = _option(1, "micro-batches per optimizer step")
    learning_rate: float = _option(1e-4, "peak learning rate of AdamW")
    weight_decay: float = _option(0.0, "AdamW weight decay")
    adam_beta1: float = _option(0.9, "AdamW beta1")
    adam_beta2: float = _option(0.999, "AdamW beta2")
    adam_epsilon: float = _option(1e-8, "AdamW epsilon")
    optim: str = _option(OptimizerName.ADAMW_TORCH_FUSED.value, "AdamW implementation, as transformers names it: "
                                                            "adamw_torch_fused (torch's fused kernel, HF Trainer's "
                                                            "default) | adamw_torch (foreach)")
    lr_scheduler_type: str = _option("cosine", "learning-rate schedule after warmup: cosine | linear | constant")
    warmup_ratio: float = _option(0.0, "fraction of the steps spent warming the learning rate up from 0")
    warmup_steps: int = _option(0, "warmup steps; > 0 overrides warmup_ratio")
    max_grad_norm: float = _option(1.0, "clip the global gradient norm (over every rank) to this")
    seed: int = _option(42, "seed of the data order, the #N subsets and fresh LoRA weights")
    logging_steps: int = _option(5, "log loss, learning rate and expert load every N steps")
    save_steps: int = _option(0, "save a checkpoint every N steps; 0: only at the end")
    save_total_limit: int | None = _option(None, "keep the newest N checkpoints; null: keep all")
    save_only_model: bool = _option(False, "skip optimizer state (smaller, but not resumable exactly)")
    async_save: bool = _option(False, "save in the background: training waits only while each rank copies its share "
                                      "to host memory (default off until it has run a release on a cluster)")
    max_shard_size: str = _option("5GB", "largest safetensors file of a saved model, as save_pretrained's")
    resume_from_checkpoint: str | None = _option(None, "a checkpoint-* directory, or a run directory (its newest "
                                                       "checkpoint is used)")
    gradient_checkpointing: bool = _option(False, "recompute each decoder layer in the backward (EP dispatch "
                                                  "replayed)")
    router_aux_loss_coef: float = _option(0.0, "the model's own load-balancing loss, its token fractions counted "
                                               "over the global batch; 0: off")
    load_balance_coeff: float = _option(0.0, "aux-loss-free balancing of routers with e_score_correction_bias "
                                             "(DeepSeek-V3): the bias step size; 0: off")
    merge_lora: bool = _option(False, "after the last step, merge the LoRA adapters into the base and save it "
                                      "beside the last checkpoint as checkpoint-{N}-merged (swift export's "
                                      "--merge_lora)")
    merged_format: str = _option("bf16", "bf16 | release: with merge_lora, a plain checkpoint in the model's "
                                         "dtype, or a quantized release's own files for every weight no adapter "
                                         "touched (the merged weights in the model's dtype)")
    peak_tflops: float = _option(0.0, "the device's peak TFLOPS for mfu; 0: known devices (H100, H200, Ascend "
                                      "910B) only")

    def __post_init__(self) -> None:
        if self.merged_format not in ("bf16", "release"):
            raise ValueError(f"merged_format={self.merged_format!r}; use 'bf16' or 'release'")
        if self.optim not in OPTIMIZERS:  # (a RecipeError naming its key: twinkle-sft prints it before launch)
            reason = f"{self.optim!r} is not an AdamW implementation twinkle-sft has; use one of {', '.join(OPTIMIZERS)}"
            raise RecipeError(f"optim={reason}", key="train.optim", reason=reason)
        if self.lr_scheduler_type not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}; use 'cosine', 'linear' or 'constant'")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("router_aux_loss_coef", "load_balance_coeff", "peak_tflops"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")

