#!/usr/bin/env bash
# LoRA on attention and experts of an MoE model with `swift sft` + the twinkle plugin
# (EP + FSDP2 + memory_efficient_init). See docs/swift.md.
#
#   bash examples/swift_sft.sh              # tiny demo Qwen3-MoE on this machine: CPU, 2 processes, EP=2
#   MODEL=Qwen/Qwen3-30B-A3B DATASET=/data/sft.jsonl NPROC_PER_NODE=8 EP=8 bash examples/swift_sft.sh
#   (several nodes: also NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, as for swift; Ascend: ASCEND_RT_VISIBLE_DEVICES)
#
# Extra arguments go to `swift sft` (e.g. --max_steps 20, --tuner_type full).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v swift >/dev/null 2>&1; then
  source scripts/swift_env.sh   # the swift env (constraints-swift.txt): torch 2.14.1, ms-swift 4.6.0; this package on PYTHONPATH
fi
PLUGIN=$(twinkle-sft --swift-plugin-path)

DATASET=${DATASET:-examples/data/demo_sft.jsonl}
if [ -z "${MODEL:-}" ]; then
  # The embedded demo: a tiny Qwen3-MoE with a BPE tokenizer trained on the demo dataset (ChatML template).
  MODEL=output/tiny/demo
  python -c "from twinkle_strategy.train.demo_model import prepare_demo_model as p; p('$MODEL', '$DATASET')"
  DEMO_ARGS=(--template qwen3_nothinking --torch_dtype float32 --max_steps 20 --learning_rate 5e-3
             --lora_rank 4 --lora_alpha 8 --per_device_train_batch_size 2)
  export NPROC_PER_NODE=${NPROC_PER_NODE:-2} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  DEMO_ARGS=(--torch_dtype bfloat16 --lora_rank 16 --lora_alpha 32 --learning_rate 1e-4)
fi

export TWINKLE_EP_SIZE=${EP:-2}
export TWINKLE_MEMORY_EFFICIENT_INIT=${MEMORY_EFFICIENT_INIT:-true}

swift sft --external_plugins "$PLUGIN" \
  --model "$MODEL" --dataset "$DATASET" \
  --tuner_type lora --lora_dropout 0 \
  --target_modules q_proj k_proj v_proj o_proj \
  --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj \
  --logging_steps 5 --save_steps 10 --output_dir output/swift_sft \
  --dataloader_num_workers 0 --report_to none --check_model false \
  "${DEMO_ARGS[@]}" "$@"
