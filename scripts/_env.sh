# Shared set-up for scripts/*.sh: a virtualenv in .venv with torch 2.13.0 and this package.
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e '.[test]'
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
