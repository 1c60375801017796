#!/usr/bin/env bash
# A local stack on one host: Prefect server (SQLite), a work pool of the project's worker type (resident-process:
# flow runs forked warm) and its worker, the deployments, and the relay that forwards the pool's events to Prefect
# (so the shipped automations can fire). The resident pool itself starts on the
# first request; `down` stops it too, with its model workers.
#   infra/local/stack.sh up|down|status       (make stack-up, make stack-down, make stack-status)
#   infra/local/stack.sh server|worker|deploy (one piece in the foreground: make server, worker, deploy)
# Logs, pid files, Prefect's database and the API's auth string live in $STACK_DIR (default .stack/ in
# the repo), a folder only you can read: every local user reaches the server's loopback port, and
# without the auth string (made once, 0600, in $STACK_DIR/auth) each of them gets 401. The worker's
# flow runs read inputs only under $INPUT_ROOT (default the inbox), write outputs under $OUTPUT_ROOT
# (default: beside the inputs) and take providers from $MANIFESTS: the worker's own environment, which
# no flow run can change (docs/security.md).
# Any local user may also bind the port first and answer /api/health: nothing gets the auth string (deploy,
# the worker, the relay) until the port's listener is yours, and for `up` the server this script started.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
PORT=${PREFECT_PORT:-4200}
POOL=${WORK_POOL:-resident-pool}
STACK_DIR=${STACK_DIR:-$PWD/.stack}
INBOX=${INBOX:-$STACK_DIR/inbox}
INPUT_ROOT=${INPUT_ROOT:-$INBOX}
OUTPUT_ROOT=${OUTPUT_ROOT:-}
MANIFESTS=${MANIFESTS:-${RESIDENT_POOL_MANIFESTS:-$PWD/manifests}}
SCREEN_CRON=${SCREEN_CRON:-0 2 * * *}
AUTH_FILE=$STACK_DIR/auth
DEMO_INPUT=uniprot-500.fasta  # data/'s, copied into the inbox by `up`
export PREFECT_API_URL="http://127.0.0.1:${PORT}/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_HOME=${PREFECT_HOME:-$STACK_DIR/prefect-home}
PROCESSES="server worker relay"

private_folder() {  # the stack's folder: yours, 0700 (it holds the auth string, the database and the logs)
  mkdir -p -m 700 "$STACK_DIR"
  if [ -L "$STACK_DIR" ] || [ "$(stat -c %u "$STACK_DIR")" != "$(id -u)" ]; then
    echo "$STACK_DIR is not a folder of yours; set STACK_DIR to one" >&2; exit 1
  fi
  chmod 700 "$STACK_DIR"
}

auth_string() {  # prints nothing; sets AUTH from $AUTH_FILE, made once (user:secret, 0600)
  private_folder
  if [ ! -e "$AUTH_FILE" ]; then
    (umask 077; printf 'resident-pool:%s' "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$AUTH_FILE")
  fi
  if [ -L "$AUTH_FILE" ] || [ "$(stat -c %u:%a "$AUTH_FILE")" != "$(id -u):600" ]; then
    echo "$AUTH_FILE must be a file of yours, mode 0600 (chmod 600 it, or remove it for a new one)" >&2; exit 1
  fi
  AUTH=$(cat "$AUTH_FILE")
}

# The secrets go to each process through its environment (readable by you alone), never its command line.
server_env() { export PREFECT_SERVER_API_AUTH_STRING="$AUTH"; }
client_env() { export PREFECT_API_AUTH_STRING="$AUTH"; }
worker_env() {
  client_env
  export RESIDENT_POOL_MANIFESTS="$MANIFESTS" RESIDENT_POOL_INPUT_ROOT="$INPUT_ROOT"
  if [ -n "$OUTPUT_ROOT" ]; then export RESIDENT_POOL_OUTPUT_ROOT="$OUTPUT_ROOT"; fi
}

# Whose socket answers on 127.0.0.1:$PORT (resident_pool/host/listeners.py): 0 yours, 1 another's, 3 nobody's.
holder() { "$VENV/bin/python" -m resident_pool.host.listeners "$PORT" "$@"; }

port_free_or_ours() {  # before starting the server: a port another user holds is refused, never shared
  local said code=0
  said=$(holder 2>&1) || code=$?
  if [ "$code" = 1 ]; then
    echo "port $PORT: $said; the stack will not start there, nor send its auth string to it: stop that" \
      "process, or set PREFECT_PORT to a free port" >&2
    exit 1
  fi
}

server_is_ours() {  # before anything gets the auth string: the listener is yours (with a pid file: that server's)
  local said code=0 session=()
  if [ -f "$STACK_DIR/server.pid" ] && kill -0 "$(cat "$STACK_DIR/server.pid")" 2>/dev/null; then
    session=(--session "$(cat "$STACK_DIR/server.pid")")
  fi
  said=$(holder "${session[@]}" 2>&1) || code=$?
  case $code in
    0) return 0 ;;
    3) echo "port $PORT: nothing listens there; start the server first (make stack-up, or make server)" >&2 ;;
    *) echo "port $PORT: $said; the auth string is not sent to it: stop that process, or set PREFECT_PORT to" \
         "the port of your server" >&2 ;;
  esac
  exit 1
}

wait_for_our_server() {  # the server this script started, listening, or why not
  local pid said code
  pid=$(cat "$STACK_DIR/server.pid")
  for _ in $(seq 1 300); do
    code=0; said=$(holder --session "$pid" 2>&1) || code=$?
    if [ "$code" = 0 ]; then
      curl -fsS "http://127.0.0.1:${PORT}/api/health" >/dev/null 2>&1 && return 0
    elif [ "$code" = 1 ]; then
      stop server >/dev/null
      echo "port $PORT: $said; the stack's server could not take it (see $STACK_DIR/server.log) and nothing" \
        "was sent there: stop that process, or set PREFECT_PORT to a free port" >&2
      exit 1
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "server did not come up; see $STACK_DIR/server.log" >&2
  exit 1
}

SERVER=("$VENV/bin/prefect" server start --host 127.0.0.1 --port "$PORT")
WORKER=("$VENV/bin/prefect" worker start --pool "$POOL" --type resident-process)
RELAY=("$VENV/bin/resident-pool" events --to-prefect)

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

deploy() {  # the deployments, registered as the worker will run them
  client_env
  # The nightly screen and validation are registered paused: a laptop must not screen at night.
  # Crons are read in this host's time zone ($TZ, else the system's); SCREEN_TIMEZONE names another.
  "$VENV/bin/python" flows/deploy.py --work-pool "$POOL" --manifests "$MANIFESTS" --schedule "$SCREEN_CRON" \
    --inbox "$INBOX" --input-root "$INPUT_ROOT" --default-input "$INBOX/$DEMO_INPUT" --paused \
    ${SCREEN_TIMEZONE:+--timezone "$SCREEN_TIMEZONE"} "$@"
}

inbox() {  # the inbox, with the demo's input file in it (the screen form's default): a new user's first screen
  mkdir -p "$INBOX"
  if [ ! -e "$INBOX/$DEMO_INPUT" ] && [ ! -L "$INBOX/$DEMO_INPUT" ]; then
    cp "data/$DEMO_INPUT" "$INBOX/$DEMO_INPUT"
    echo "the demo input is in the inbox: $INBOX/$DEMO_INPUT (the screen form's default input)"
  fi
}

case "${1:-}" in
  up)
    auth_string
    if ! { [ -f "$STACK_DIR/server.pid" ] && kill -0 "$(cat "$STACK_DIR/server.pid")" 2>/dev/null; }; then
      port_free_or_ours
    fi
    (server_env; start server "${SERVER[@]}")
    wait_for_our_server
    inbox
    (deploy >>"$STACK_DIR/deploy.log" 2>&1) || { echo "deploy failed; see $STACK_DIR/deploy.log"; exit 1; }
    echo "deployments registered on work pool $POOL; the nightly screen of $INBOX and validate are registered"
    echo "  paused: on each one's page, the toggle beside the Schedules heading (the deployment's own) runs them"
    server_is_ours
    (worker_env; start worker "${WORKER[@]}")
    (worker_env; start relay "${RELAY[@]}")
    echo "flow runs read under $INPUT_ROOT, write under ${OUTPUT_ROOT:-the folders of the inputs}, use providers of $MANIFESTS"
    echo "UI: http://127.0.0.1:${PORT} (it asks for the auth string: the contents of $AUTH_FILE)"
    echo "CLI: PREFECT_API_URL=$PREFECT_API_URL PREFECT_API_AUTH_STRING=\$(cat $AUTH_FILE) $VENV/bin/prefect deployment run predict/predict"
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
  server) auth_string; port_free_or_ours; server_env; exec "${SERVER[@]}" ;;
  worker) auth_string; server_is_ours; worker_env; exec "${WORKER[@]}" ;;
  deploy) auth_string; server_is_ours; inbox; shift; deploy "$@" ;;
  *) echo "usage: $0 up|down|status|server|worker|deploy" >&2; exit 2 ;;
esac
