"""`make stack-up` (infra/local/stack.sh) against another local user who holds its port first.

The stack's other guard (no request without the auth string is served; no flow run chooses the command,
environment or folder its worker starts it with) is checked in tests/test_ui.py, on the stack that file's tests
share: one `stack.sh up` less per run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "infra" / "local" / "stack.sh"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


SQUATTER = textwrap.dedent("""
    import http.server, json, sys
    log = open(sys.argv[2], "a", buffering=1)
    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self):
            size = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(size)
            log.write(json.dumps({"path": self.path, "authorization": self.headers.get("Authorization")}) + "\\n")
            body = b"true" if "health" in self.path else b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = answer
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


def test_the_stack_refuses_a_port_another_user_holds_and_never_sends_it_the_auth_string(other_user, isolated_dirs,
                                                                                       security_row):
    """Another local user takes the stack's port first (any user may bind a loopback port) with a server that
    answers /api/health. `up` used to start its own server (which failed: the port was taken), see a healthy
    server, and have `deploy` send the auth string in its Authorization header: the key to the real server
    whenever it runs. `up`, `deploy` and `worker` each refuse the port, naming its holder, and send nothing."""
    from conftest import SYSTEM_PYTHON

    base = Path(tempfile.mkdtemp(prefix="rp-squat-"))
    os.chmod(base, 0o755)
    seen = base / "seen"
    seen.mkdir()
    shutil.chown(seen, other_user, other_user)
    script = base / "squat.py"
    script.write_text(SQUATTER)
    script.chmod(0o644)
    port = free_port()
    squatter = subprocess.Popen(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups",
                                 SYSTEM_PYTHON, str(script), str(port), str(seen / "requests.jsonl")])
    folder = base / "stack"
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update({"PREFECT_PORT": str(port), "STACK_DIR": str(folder), "VENV": str(Path(sys.executable).parents[1]),
                "WORK_POOL": f"rp-squat-{uuid.uuid4().hex[:6]}"})
    try:
        wait_until(lambda: _answers(port), timeout=30, message="the other user's server to listen")
        said = {}
        for command in ("up", "deploy", "worker"):
            done = subprocess.run([str(STACK), command], env=env, capture_output=True, text=True, timeout=400,
                                  check=False)
            said[command] = done.stdout + done.stderr
            assert done.returncode != 0, (command, said[command])
            assert f"port {port}: 127.0.0.1:{port} is held by another user, uid" in said[command], said[command]
            assert f"({other_user})" in said[command], said[command]
        auth = (folder / "auth").read_text()
        log = seen / "requests.jsonl"
        sent = [json.loads(line)["authorization"] for line in log.read_text().splitlines()] if log.exists() else []
        assert not any(sent), f"the other user's server received {sent}; the stack said {said}"
        assert auth not in json.dumps(said)
        assert not (folder / "server.pid").exists() and not (folder / "worker.pid").exists()
    finally:
        subprocess.run([str(STACK), "down"], env=env, capture_output=True, timeout=120, check=False)
        squatter.send_signal(signal.SIGTERM)
        squatter.wait(timeout=30)
        shutil.rmtree(base, ignore_errors=True)
    security_row("another local user holds the stack's port first with a server that answers /api/health",
                 "`stack.sh up`, `deploy` and `worker` refuse the port, naming the holder's uid",
                 "no request with credentials (it used to get the auth string from `deploy`)")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
