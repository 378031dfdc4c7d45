#!/usr/bin/env bash
# Set up .venv (torch 2.13.0 + twinkle_strategy) and run the whole test suite on CPU/gloo.
source "$(dirname "$0")/_env.sh"
python -m pytest -q -p no:cacheprovider tests "$@"
