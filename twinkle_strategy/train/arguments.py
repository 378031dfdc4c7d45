"""``TrainingArguments``: the trainer's options, named as transformers' and swift's (each is also a twinkle-sft flag)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TrainingArguments:
    output_dir: str = "output"
    add_version: bool = True  # write into output_dir/v{N}-{YYYYMMDD-HHMMSS}, like swift
    num_train_epochs: float = 1.0
    max_steps: int = -1  # > 0 overrides num_train_epochs
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    seed: int = 42
    logging_steps: int = 5
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    save_only_model: bool = False  # skip optimizer state (smaller, but not resumable exactly)
    # Save in the background: training waits only while each rank copies its share to host memory (default off
    # until it has run a release on a cluster).
    async_save: bool = False
    max_shard_size: str = "5GB"  # largest safetensors file of a saved model, as save_pretrained's
    resume_from_checkpoint: str | None = None  # a checkpoint-* directory, or a run directory (latest is used)
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward (EP dispatch replayed)
    # The model's own load-balancing loss, its token fractions counted over the global batch; 0 = off.
    router_aux_loss_coef: float = 0.0
    # Aux-loss-free balancing of routers with e_score_correction_bias (DeepSeek-V3): bias step size; 0 = off.
    load_balance_coeff: float = 0.0
    peak_tflops: float = 0.0  # the device's peak for mfu; 0: known devices (H100, H200, Ascend 910B) only

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in ("cosine", "linear", "constant"):
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}; use 'cosine', 'linear' or 'constant'")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("router_aux_loss_coef", "load_balance_coeff", "peak_tflops"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns it off), got {getattr(self, name)}")

