# Shared set-up for scripts/*.sh: a virtualenv in .venv with the pinned set (constraints.txt: torch 2.13.0,
# transformers, peft and every other dependency at one version each) and this package in editable mode.
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build. pip runs only when
# .venv is not current: the stamp .venv/.twinkle-env (a hash of constraints.txt, setup.py and this checkout's
# path) differs, or an installed version differs from its pin (dot_venv_is_current in scripts/_venvs.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_venvs.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! dot_venv_is_current .venv constraints.txt; then
  echo "installing the pinned set (constraints.txt) into .venv" >&2
  rm -f .venv/.twinkle-env
  pip_quiet -c constraints.txt "$(grep -E '^torch==' constraints.txt)"
  # pytest-xdist: the suite's two workers (scripts/test.sh). Beside the extra, not in it: no user of this package
  # needs it, and a setup.py change rebuilds every cached env (scripts/_venvs.sh), which do not run pytest -n.
  pip_quiet -c constraints.txt -e '.[test]' pytest-xdist
  python scripts/venv_current.py constraints.txt
  dot_venv_stamp constraints.txt > .venv/.twinkle-env
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
