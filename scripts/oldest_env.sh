# The virtualenv with the oldest versions setup.py allows (constraints-oldest.txt: torch, transformers and peft
# at their lower bounds), built once per machine outside the checkout (scripts/_venvs.sh). Idempotent.
#   bash scripts/oldest_env.sh      # create if absent or out of date; prints its path
#   source scripts/oldest_env.sh    # the same, and activate it in this shell (this checkout on PYTHONPATH)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venvs.sh"
TWINKLE_OLDEST_VENV=$(ensure_venv oldest)
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  . "$TWINKLE_OLDEST_VENV/bin/activate"
  export PYTHONPATH=$(venv_pythonpath) OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
else
  echo "$TWINKLE_OLDEST_VENV"
fi
