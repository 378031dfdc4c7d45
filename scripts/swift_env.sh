# Set-up for the ms-swift integration tests and examples: a second virtualenv with exactly
# constraints-swift.txt: ms-swift 4.6.0 with the transformers<5.20 and peft<0.21 it needs (older than
# .venv's), qwen-vl-utils, torch 2.14.1 + torchvision 0.29.1, and this package's other dependencies.
# It is built once per machine outside the checkout, in
# ${TWINKLE_VENV_CACHE:-~/.cache/twinkle_strategy/venvs}/swift-<hash of its constraints and setup.py>
# (scripts/_venvs.sh), so a fresh clone reuses it; `bash scripts/venv_path.sh swift` prints the path.
# Idempotent: when it is current, a run only checks (a fraction of a second). The package itself is not
# installed there: it comes from this checkout on PYTHONPATH, which sourcing sets.
# torchvision: transformers' Qwen3-VL / Qwen3.5 processors need it for images, and PyPI's
# torchvision does not import beside .venv's torch 2.13.0 CPU wheel; 2.14.1 + 0.29.1 is a pair
# that does (on x86_64 / Python 3.11 pip takes both from this machine's disk; a CUDA build,
# which runs on the CPU too). Both are installed first and pinned in every later pip call, so
# pip never swaps torch for another build.
#   bash scripts/swift_env.sh            # create if absent or out of date; prints its path
#   source scripts/swift_env.sh          # the same, and activate it in this shell (swift sft, twinkle-sft)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venvs.sh"
TWINKLE_SWIFT_VENV=$(ensure_venv swift)
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  . "$TWINKLE_SWIFT_VENV/bin/activate"
  export PYTHONPATH=$(venv_pythonpath) OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
else
  echo "$TWINKLE_SWIFT_VENV"
fi
