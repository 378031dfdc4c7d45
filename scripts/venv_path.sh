#!/usr/bin/env bash
# The path of a cached virtualenv (swift, oldest, vllm; see scripts/_venvs.sh), whether built or not:
#   bash scripts/venv_path.sh swift      # e.g. ~/.cache/twinkle_strategy/venvs/swift-0123456789ab
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venvs.sh"
venv_path "${1:?usage: venv_path.sh swift|oldest|vllm}"
