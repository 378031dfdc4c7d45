# Shared set-up for scripts/*.sh: a virtualenv in .venv with the pinned set (constraints.txt: torch 2.13.0,
# transformers, peft and every other dependency at one version each) and this package in editable mode.
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build. pip runs only when
# .venv is not current: the stamp .venv/.twinkle-env (a hash of constraints.txt, setup.py and this checkout's
# path) differs, or an installed version differs from its pin (scripts/venv_current.py reads the metadata).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venvs.sh
PY=${PYTHON:-python3}
_stamp=$({ echo "$PWD"; cat constraints.txt setup.py; } | sha256sum | cut -c1-64)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if [ "$(cat .venv/.twinkle-env 2>/dev/null)" != "$_stamp" ] || ! python scripts/venv_current.py constraints.txt 2>/dev/null; then
  echo "installing the pinned set (constraints.txt) into .venv" >&2
  rm -f .venv/.twinkle-env
  pip_quiet -c constraints.txt "$(grep -E '^torch==' constraints.txt)"
  pip_quiet -c constraints.txt -e '.[test]'
  python scripts/venv_current.py constraints.txt
  echo "$_stamp" > .venv/.twinkle-env
fi
unset _stamp
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
