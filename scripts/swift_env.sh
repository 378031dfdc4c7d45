# Set-up for the ms-swift integration tests and examples: a second virtualenv, .venv-swift,
# with torch 2.13.0, ms-swift 4.6.0 (which needs transformers<5.20 and peft<0.21, older than
# .venv's) and this package in editable mode. Idempotent: a second run only checks.
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build.
#   bash scripts/swift_env.sh            # create/update; then .venv-swift/bin/swift sft ...
#   source scripts/swift_env.sh          # the same, and activate it in this shell
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
SWIFT_VERSION=${TWINKLE_SWIFT_VERSION:-4.6.0}
if [ ! -x .venv-swift/bin/python ]; then
  "$PY" -m venv .venv-swift
fi
. .venv-swift/bin/activate
if ! python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0
fi
if ! python - "$SWIFT_VERSION" <<'PYCHECK' 2>/dev/null; then
import sys
from importlib.metadata import version
ok = version("ms-swift") == sys.argv[1] and version("twinkle_strategy")
ok = ok and version("transformers").startswith("5.") and version("peft") < "0.21"
sys.exit(0 if ok else 1)
PYCHECK
  python -m pip install -q "ms-swift==$SWIFT_VERSION" 'transformers>=5,<5.20' 'peft>=0.17,<0.21' torch==2.13.0
  python -m pip install -q -e . "ms-swift==$SWIFT_VERSION" "transformers>=5,<5.20" "peft>=0.17,<0.21" torch==2.13.0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
