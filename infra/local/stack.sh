#!/usr/bin/env bash
# A local stack on one host: Prefect server (SQLite), a process work pool and its
# worker, the deployments. The resident pool itself starts on the first request.
#   infra/local/stack.sh up|down|status
# Logs and pid files live together in $STACK_DIR (default .stack/ in the repo).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PORT=${PREFECT_PORT:-4200}
POOL=${WORK_POOL:-resident-pool}
STACK_DIR=${STACK_DIR:-$PWD/.stack}
INBOX=${INBOX:-$STACK_DIR/inbox}
SCREEN_CRON=${SCREEN_CRON:-0 2 * * *}
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_HOME=${PREFECT_HOME:-$STACK_DIR/prefect-home}

start() {  # name, command...
  local name=$1; shift
  if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$STACK_DIR/$name.pid"))"; return
  fi
  setsid "$@" >>"$STACK_DIR/$name.log" 2>&1 < /dev/null &
  echo $! >"$STACK_DIR/$name.pid"
  echo "$name started (pid $!, log $STACK_DIR/$name.log)"
}

stop() {  # name
  local name=$1 pid
  [ -f "$STACK_DIR/$name.pid" ] || return 0
  pid=$(cat "$STACK_DIR/$name.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    echo "$name stopped"
  fi
  rm -f "$STACK_DIR/$name.pid"
}

case "${1:-}" in
  up)
    mkdir -p "$STACK_DIR"
    start server "$VENV/bin/prefect" server start --host 127.0.0.1 --port "$PORT"
    for _ in $(seq 1 300); do
      curl -fsS "http://127.0.0.1:${PORT}/api/health" >/dev/null 2>&1 && break; sleep 0.5
    done
    curl -fsS "http://127.0.0.1:${PORT}/api/health" >/dev/null || { echo "server did not come up; see $STACK_DIR/server.log"; exit 1; }
    mkdir -p "$INBOX"
    # The nightly screen and validation are registered paused: a laptop must not screen at night.
    "$VENV/bin/python" flows/deploy.py --work-pool "$POOL" --schedule "$SCREEN_CRON" --inbox "$INBOX" --paused \
      >>"$STACK_DIR/deploy.log" 2>&1 || { echo "deploy failed; see $STACK_DIR/deploy.log"; exit 1; }
    echo "deployments registered on work pool $POOL; nightly screen of $INBOX registered paused (resume it in the UI)"
    start worker "$VENV/bin/prefect" worker start --pool "$POOL" --type process
    echo "UI: http://127.0.0.1:${PORT}  (run: PREFECT_API_URL=$PREFECT_API_URL $VENV/bin/prefect deployment run predict/predict)"
    ;;
  down)
    stop worker
    stop server
    "$VENV/bin/resident-pool" stop --all >/dev/null 2>&1 || true
    ;;
  status)
    for name in server worker; do
      if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2>/dev/null; then
        echo "$name: running (pid $(cat "$STACK_DIR/$name.pid"))"; else echo "$name: stopped"; fi
    done
    ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
