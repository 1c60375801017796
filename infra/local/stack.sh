#!/usr/bin/env bash
# A local stack on one host: Prefect server (SQLite), a process work pool and its
# worker, the deployments, and the relay that forwards the pool's events to Prefect
# (so the shipped automations can fire). The resident pool itself starts on the
# first request; `down` stops it too, with its model workers.
#   infra/local/stack.sh up|down|status
# Logs and pid files live together in $STACK_DIR (default .stack/ in the repo).
# The providers are $RESIDENT_POOL_MANIFESTS (default manifests/ in the repo): the
# worker host's own setting, which flow runs inherit and no form can change.
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
export RESIDENT_POOL_MANIFESTS=${RESIDENT_POOL_MANIFESTS:-$PWD/manifests}
PROCESSES="server worker relay"

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
    # Crons are read in this host's time zone ($TZ, else the system's); SCREEN_TIMEZONE names another.
    "$VENV/bin/python" flows/deploy.py --work-pool "$POOL" --manifests "$RESIDENT_POOL_MANIFESTS" \
      --schedule "$SCREEN_CRON" --inbox "$INBOX" --paused ${SCREEN_TIMEZONE:+--timezone "$SCREEN_TIMEZONE"} \
      >>"$STACK_DIR/deploy.log" 2>&1 || { echo "deploy failed; see $STACK_DIR/deploy.log"; exit 1; }
    echo "deployments registered on work pool $POOL; the nightly screen of $INBOX and validate are registered"
    echo "  paused: on each one's page, the toggle beside the Schedules heading (the deployment's own) runs them"
    start worker "$VENV/bin/prefect" worker start --pool "$POOL" --type process
    start relay "$VENV/bin/resident-pool" events --to-prefect
    echo "UI: http://127.0.0.1:${PORT}  (run: PREFECT_API_URL=$PREFECT_API_URL $VENV/bin/prefect deployment run predict/predict)"
    ;;
  down)
    stop worker
    stop relay
    # The pool and its model workers: flow runs started it in the background, so no pid file of ours has it.
    "$VENV/bin/python" -c 'from resident_pool.client import shutdown_pool
pid = shutdown_pool()
print(f"pool stopped (pid {pid}) with its workers" if pid else "no pool was running")'
    stop server
    ;;
  status)
    for name in $PROCESSES; do
      if [ -f "$STACK_DIR/$name.pid" ] && kill -0 "$(cat "$STACK_DIR/$name.pid")" 2>/dev/null; then
        echo "$name: running (pid $(cat "$STACK_DIR/$name.pid"))"; else echo "$name: stopped"; fi
    done
    "$VENV/bin/python" - <<'EOF'
from resident_pool.client import Pool
from resident_pool.errors import ResidentPoolError
try:
    with Pool(start=False) as pool:
        status = pool.status()
    print(f"pool: running (pid {status['pool']['pid']}, {len(status['workers'])} worker(s))")
except (OSError, ResidentPoolError):
    print("pool: stopped")
EOF
    ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
