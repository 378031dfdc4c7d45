#!/usr/bin/env bash
# Image-text LoRA fine-tuning of a vision-language MoE model with `swift sft` + the twinkle plugin
# (EP + FSDP2 + memory_efficient_init): LoRA on the language model's linear layers (attention) and
# on its experts, vision tower frozen. See docs/swift.md.
#
#   bash examples/swift_vl_sft.sh                           # tiny Qwen3-VL-MoE, generated PNGs: CPU, 2 processes, EP=2
#   FAMILY=qwen3_5_moe_vl bash examples/swift_vl_sft.sh     # tiny Qwen3.5-MoE (vision tower included)
#   MODEL=Qwen/Qwen3-VL-30B-A3B-Instruct DATASET=/data/vl_sft.jsonl NPROC_PER_NODE=8 EP=8 bash examples/swift_vl_sft.sh
#   (several nodes: also NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, as for swift; Ascend: ASCEND_RT_VISIBLE_DEVICES)
#
# DATASET is swift's image-text JSONL: {"messages": [{"role": "user", "content": "<image>What is this?"},
# {"role": "assistant", "content": "A red square."}], "images": ["/path/to/red_square.png"]}.
# Extra arguments go to `swift sft` (e.g. --max_steps 20, --freeze_vit false to train the vision tower too).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v swift >/dev/null 2>&1; then
  source scripts/swift_env.sh   # the swift env: torch 2.14.1 + torchvision 0.29.1, ms-swift 4.6.0; this package on PYTHONPATH
fi
PLUGIN=$(twinkle-sft --swift-plugin-path)

if [ -z "${MODEL:-}" ]; then
  # The embedded demo: PNGs drawn at run time (coloured squares and circles, 32x32) and a tiny
  # vision-language MoE saved from its image-text-to-text class with a real Qwen3VLProcessor.
  FAMILY=${FAMILY:-qwen3_vl_moe}
  if [ -z "${DATASET:-}" ]; then
    DATASET=$(python -c "from twinkle_strategy.testing.tiny_vision import write_vl_demo_dataset as w; print(w('output/tiny/vl_data'))")
  fi
  MODEL=output/tiny/${FAMILY}_demo
  python -c "from twinkle_strategy.testing.tiny_vision import prepare_vl_demo_model as p; p('$MODEL', '$DATASET', family='$FAMILY')"
  DEMO_ARGS=(--torch_dtype float32 --max_steps 20 --learning_rate 5e-3
             --lora_rank 4 --lora_alpha 8 --per_device_train_batch_size 2)
  export NPROC_PER_NODE=${NPROC_PER_NODE:-2} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  DEMO_ARGS=(--torch_dtype bfloat16 --lora_rank 16 --lora_alpha 32 --learning_rate 1e-4)
fi

export TWINKLE_EP_SIZE=${EP:-2}
export TWINKLE_MEMORY_EFFICIENT_INIT=${MEMORY_EFFICIENT_INIT:-true}

# all-linear: swift's choice of linear layers, limited by --freeze_vit/--freeze_aligner/--freeze_llm
# (the language model's attention here; with --freeze_vit false the vision tower's too).
swift sft --external_plugins "$PLUGIN" \
  --model "$MODEL" --dataset "$DATASET" \
  --tuner_type lora --lora_dropout 0 --freeze_vit true \
  --target_modules all-linear \
  --target_parameters mlp.experts.gate_up_proj mlp.experts.down_proj \
  --logging_steps 5 --save_steps 10 --output_dir output/swift_vl_sft \
  --dataloader_num_workers 0 --report_to none --check_model false \
  "${DEMO_ARGS[@]}" "$@"
