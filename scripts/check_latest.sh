#!/usr/bin/env bash
# Try the newest releases: a throwaway virtualenv with the newest transformers, peft, torch and every other
# dependency setup.py names, from the registry, without constraints.txt and without setup.py's bounds; prints
# the versions it got (and which fall outside setup.py's ranges), then runs the smoke subset on them
# (scripts/smoke.sh: tests/multiproc/test_smoke.py, and tests/unit/test_internals.py, whose tests name the internal that moved
# and the installed version). Exit status: the tests'. Run it on a release day, before raising a bound:
#   bash scripts/check_latest.sh                 # a few minutes; the env is deleted at the end
#   KEEP_VENV=1 bash scripts/check_latest.sh     # keep it (its path is printed) to debug a failure
#   TORCH_SPEC='torch==2.14.1' bash scripts/check_latest.sh   # choose the torch build (default: the newest release,
#                                                               # past this machine's pip cap; see PIP_CONFIG_FILE below)
# torch is installed first and pinned afterwards, so pip never swaps the build it chose.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venvs.sh
VENV=$(mktemp -d "${TMPDIR:-/tmp}/twinkle-latest.XXXXXX")
if [ -z "${KEEP_VENV:-}" ]; then trap 'rm -rf "$VENV"' EXIT; fi
start=$SECONDS
"$TWINKLE_PY" -m venv "$VENV"
. "$VENV/bin/activate"
# This machine's pip config caps torch through a global constraints file (`pip config list`: global.constraint), so
# "the newest torch" would be the cap, not the newest release. In this throwaway env pip reads no config file and
# gets the config's indexes, links and certificate back through the environment. CHECK_LATEST_PIP_CONFIG=keep
# keeps the config (and its caps).
if [ "${CHECK_LATEST_PIP_CONFIG:-}" != keep ]; then
  for key in index-url extra-index-url find-links cert trusted-host; do
    var=PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')
    value=$(python -m pip config get "global.$key" 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${value// /}" ] && [ -z "${!var:-}" ]; then export "$var=${value% }"; fi
  done
  export PIP_CONFIG_FILE=/dev/null
  echo "check_latest: pip reads no config file here (caps lifted); indexes: ${PIP_INDEX_URL:-PyPI} ${PIP_EXTRA_INDEX_URL:-}"
fi
pip_quiet --upgrade "${TORCH_SPEC:-torch}"
TORCH_PIN=torch==$(python -c 'from importlib.metadata import version; print(version("torch"))')
# setup.py's requirements (install_requires and the test extra), names only: the newest of each.
mapfile -t DEPS < <(python - <<'EOF'
import ast
import re

call = next(node for node in ast.walk(ast.parse(open("setup.py").read()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
for req in kw["install_requires"] + kw["extras_require"]["test"]:
    name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
    if name != "torch":
        print(name)
EOF
)
[ "${#DEPS[@]}" -gt 0 ] || { echo "check_latest: no requirements read from setup.py" >&2; exit 2; }
pip_quiet --upgrade "${DEPS[@]}" "$TORCH_PIN"
echo "check_latest: virtualenv $VENV built in $((SECONDS - start)) s"
python - <<'EOF'
import ast
from importlib.metadata import version

from packaging.requirements import Requirement

call = next(node for node in ast.walk(ast.parse(open("setup.py").read()))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "install_requires")
print("check_latest: installed " + ", ".join(f"{Requirement(r).name} {version(Requirement(r).name)}" for r in requires)
      + ", huggingface_hub " + version("huggingface_hub") + ", tokenizers " + version("tokenizers")
      + ", accelerate " + version("accelerate"))
for r in map(Requirement, requires):
    if r.specifier and not r.specifier.contains(version(r.name), prereleases=True):
        print(f"check_latest: {r.name} {version(r.name)} is outside setup.py's range {r}: if the tests pass, "
              "run the whole suite on it and raise the bound (and constraints.txt)")
EOF
bash scripts/smoke.sh "$VENV/bin/python" "$@"
