#!/usr/bin/env bash
# Set up .venv and run the main job: LoRA on the embedded tiny MoE, 2 simulated nodes x 2 ranks, CPU.
source "$(dirname "$0")/_env.sh"
twinkle-sft yaml/demo.yaml "$@"
