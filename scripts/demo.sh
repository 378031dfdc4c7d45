#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded tiny MoE model (2 simulated nodes x 2 ranks, CPU).
source "$(dirname "$0")/_env.sh"
python examples/ep_fsdp_demo.py "$@"
