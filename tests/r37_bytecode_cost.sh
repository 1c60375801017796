#!/usr/bin/env bash
# Review r37: what `make setup`'s --no-compile (1c381bd) costs whatever runs Python outside make, in a shell with
# PYTHONDONTWRITEBYTECODE=1 (or from a venv it cannot write: the admission service's /opt/resident-pool/.venv run
# as its own user under ProtectSystem=strict). `make` unexports the variable; nothing else does.
# Run right after `make setup` in a fresh worktree, before anything has imported the dependencies.
# Prints seconds per command: with no cache (each run compiles again, nothing is kept), then with the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
export RESIDENT_POOL_STATE_DIR=$state/s RESIDENT_POOL_LOG_DIR=$state/logs  # never the host's own
secs() { local start; start=$(date +%s.%N); "$@" >/dev/null 2>&1 || true; python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)"; }
pycs() { find .venv/lib resident_pool -name '*.pyc' | wc -l; }
STATUS=(.venv/bin/resident-pool status)
WORKER=(.venv/bin/python -c 'import torch, sentence_transformers')  # what a minilm worker imports
echo "cached modules after setup: $(pycs)"
export PYTHONDONTWRITEBYTECODE=1
echo "no cache: status $(secs "${STATUS[@]}") s, again $(secs "${STATUS[@]}") s; worker imports $(secs "${WORKER[@]}") s, again $(secs "${WORKER[@]}") s; cached modules now: $(pycs)"
unset PYTHONDONTWRITEBYTECODE
secs "${STATUS[@]}" >/dev/null; secs "${WORKER[@]}" >/dev/null  # as a make target would: the cache written
echo "with the cache ($(pycs) modules): status $(secs "${STATUS[@]}") s, worker imports $(secs "${WORKER[@]}") s"
