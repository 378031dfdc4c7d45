#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): set up .venv on the pinned set (constraints.txt: torch 2.13.0 CPU,
# transformers, peft ...), lint, build the docs site, run the whole suite on CPU/gloo; then the smoke subset on the oldest versions
# setup.py allows (scripts/test_oldest.sh, its own virtualenv). Both run; either failing fails.
#   bash scripts/test.sh                     # everything
#   bash scripts/test.sh tests/unit/test_units.py # pytest arguments go to the pinned run; the oldest smoke is skipped
source "$(dirname "$0")/_env.sh"
ruff check .   # lint (pyproject.toml): unused/undefined names, import order
status=0
# The docs site (mkdocs.yml): --strict fails on a broken link or anchor between pages. Not -q: mkdocs 1.6 with -q
# hides the warnings from --strict too, and passes.
site=$(mktemp -d)
if ! mkdocs build --strict --site-dir "$site/site" > "$site/build.log" 2>&1; then
  grep -v '^INFO' "$site/build.log" >&2 || true
  status=1
fi
rm -rf "$site"
python -m pytest -q -p no:cacheprovider tests "$@" || status=$?
if [ "$#" -eq 0 ]; then
  bash scripts/test_oldest.sh || status=$((status ? status : 1))
fi
exit "$status"
