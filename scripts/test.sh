#!/usr/bin/env bash
# Set up .venv (torch 2.13.0 + twinkle_strategy), lint, and run the whole test suite on CPU/gloo.
source "$(dirname "$0")/_env.sh"
ruff check .   # lint (pyproject.toml): unused/undefined names, import order
python -m pytest -q -p no:cacheprovider tests "$@"
