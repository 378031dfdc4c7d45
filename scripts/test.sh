#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): set up .venv on the pinned set (constraints.txt: torch 2.13.0 CPU,
# transformers, peft ...), lint, run the whole suite on CPU/gloo; then the smoke subset on the oldest versions
# setup.py allows (scripts/test_oldest.sh, its own virtualenv). Both run; either failing fails.
#   bash scripts/test.sh                     # everything
#   bash scripts/test.sh tests/test_units.py # pytest arguments go to the pinned run; the oldest smoke is skipped
source "$(dirname "$0")/_env.sh"
ruff check .   # lint (pyproject.toml): unused/undefined names, import order
status=0
python -m pytest -q -p no:cacheprovider tests "$@" || status=$?
if [ "$#" -eq 0 ]; then
  bash scripts/test_oldest.sh || status=$((status ? status : 1))
fi
exit "$status"
