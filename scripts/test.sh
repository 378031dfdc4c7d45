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
if [ "$#" -eq 0 ]; then
  # The other virtualenvs (ms-swift's, vLLM's, the oldest versions'), built now in the background, one after
  # another, while the one-process and multi-process tiers run: on a new machine building them is mostly
  # download and unpacking (the vLLM one ~10-20 min), which the suite's CPU-bound launches would otherwise wait
  # for. Each build holds its env's lock, so a test that needs an env still building waits for it, and builds
  # it itself if this one failed. Already built: each only checks, in seconds.
  prebuild_log=$(mktemp)
  ( for env in swift vllm oldest; do bash "scripts/${env}_env.sh" || true; done ) > "$prebuild_log" 2>&1 &
  prebuild=$!
  # Two pytest-xdist workers (TWINKLE_TEST_WORKERS): most launches leave a core idle part of the time. Each test file,
  # and the files that share a session launch, stay on one worker (tests/parallel_workers.py).
  python -m pytest -q -p no:cacheprovider -n "${TWINKLE_TEST_WORKERS:-2}" --dist loadgroup \
    tests/unit tests/multiproc tests/swift_plugin tests/vllm_engine || status=$?
  wait "$prebuild" || true
  grep -E "^(building|built)" "$prebuild_log" >&2 || true
  rm -f "$prebuild_log"
  bash scripts/test_oldest.sh || status=$((status ? status : 1))
else
  python -m pytest -q -p no:cacheprovider tests "$@" || status=$?
fi
exit "$status"
