#!/usr/bin/env bash
# The smoke subset with a given interpreter: tests/multiproc/test_smoke.py (exact init, one bf16 parity case, save and
# resume, activation checkpointing: one launch of 2 simulated nodes x 2) and tests/unit/test_internals.py (one fast
# test per transformers/torch internal the package uses) where present.
#   bash scripts/smoke.sh PYTHON [pytest arguments]    # PYTHON: a virtualenv's python with the dependencies
# This checkout's package comes first on PYTHONPATH. Used by scripts/test_oldest.sh and scripts/check_latest.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_BIN=${1:?usage: smoke.sh PYTHON [pytest arguments]}
shift
TESTS=(tests/multiproc/test_smoke.py)
if [ -f tests/unit/test_internals.py ]; then TESTS+=(tests/unit/test_internals.py); fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
"$PYTHON_BIN" -c 'from importlib.metadata import version
print("smoke subset on " + ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "peft")))'
"$PYTHON_BIN" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
