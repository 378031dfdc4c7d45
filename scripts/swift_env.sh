# Set-up for the ms-swift integration tests and examples: a second virtualenv, .venv-swift,
# with torch 2.14.1 + torchvision 0.29.1, ms-swift 4.6.0 (which needs transformers<5.20 and
# peft<0.21, older than .venv's), qwen-vl-utils and this package in editable mode. Idempotent: a second run
# only checks.
# torchvision: transformers' Qwen3-VL / Qwen3.5 processors need it for images, and PyPI's
# torchvision does not import beside .venv's torch 2.13.0 CPU wheel; 2.14.1 + 0.29.1 is a pair
# that does (on x86_64 / Python 3.11 pip takes both from this machine's disk; a CUDA build,
# which runs on the CPU too). Both are installed first and pinned in every later pip call, so
# pip never swaps torch for another build.
#   bash scripts/swift_env.sh            # create/update; then .venv-swift/bin/swift sft ...
#   source scripts/swift_env.sh          # the same, and activate it in this shell
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
SWIFT_VERSION=${TWINKLE_SWIFT_VERSION:-4.6.0}
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
# qwen-vl-utils: swift's Qwen-VL loaders (Qwen3-VL, Qwen3.5) refuse to start without it (image resizing).
SWIFT_PINS=("ms-swift==$SWIFT_VERSION" 'transformers>=5,<5.20' 'peft>=0.17,<0.21' qwen-vl-utils==0.0.14)
if [ ! -x .venv-swift/bin/python ]; then
  "$PY" -m venv .venv-swift
fi
. .venv-swift/bin/activate
if ! python - <<'PYCHECK' 2>/dev/null; then
import sys
import torch, torchvision
# torchvision's compiled operators must have registered beside this torch (the failure mode of a mismatched pair)
ok = torch.__version__.split("+")[0] == "2.14.1" and torchvision.__version__.split("+")[0] == "0.29.1"
sys.exit(0 if ok and hasattr(torch.ops.torchvision, "nms") else 1)
PYCHECK
  python -m pip install -q --upgrade pip
  python -m pip install -q "${TORCH_PINS[@]}"
fi
if ! python - "$SWIFT_VERSION" <<'PYCHECK' 2>/dev/null; then
import sys
from importlib.metadata import version
ok = version("ms-swift") == sys.argv[1] and version("twinkle_strategy")
ok = ok and version("transformers").startswith("5.") and version("peft") < "0.21"
ok = ok and version("qwen-vl-utils") == "0.0.14"
sys.exit(0 if ok else 1)
PYCHECK
  python -m pip install -q "${SWIFT_PINS[@]}" "${TORCH_PINS[@]}"
  python -m pip install -q -e . "${SWIFT_PINS[@]}" "${TORCH_PINS[@]}"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export TOKENIZERS_PARALLELISM=false
