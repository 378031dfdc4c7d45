#!/usr/bin/env bash
# The smoke subset on the oldest versions setup.py allows (constraints-oldest.txt), in their own virtualenv
# (built once per machine, outside the checkout: scripts/oldest_env.sh). Run by scripts/test.sh after the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
venv=$(bash scripts/oldest_env.sh)
echo "oldest virtualenv ready in $((SECONDS - start)) s: $venv"
bash scripts/smoke.sh "$venv/bin/python" "$@"
