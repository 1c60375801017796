"""`make stack-up` as a real deployment would have it (infra/local/stack.sh): a real `prefect server`, its worker
and the deployments, on a temporary port and folder.

Every local user reaches the server's loopback port, so: no request without the auth string is served, and
no flow run, even with it, chooses the command, environment or folder the worker starts it with, or a path
outside the folders the worker host allows.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from helpers import free_port, wait_until

from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
STACK = ROOT / "infra" / "local" / "stack.sh"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class Api:
    """The stack's REST API, with or without the auth string."""

    def __init__(self, port: int, auth: str | None) -> None:
        self.base = f"http://127.0.0.1:{port}/api"
        self.auth = auth

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        request = urllib.request.Request(self.base + path, method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        if self.auth is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(self.auth.encode()).decode())
        for attempt in range(20):
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, json.loads(response.read() or b"null")
            except urllib.error.HTTPError as error:
                # A 503 is the server's SQLite busy on a loaded machine (seen in a full run): asked again, as
                # Prefect's own client does.
                if error.code != 503 or attempt == 19:
                    return error.code, json.loads(error.read() or b"null")
            time.sleep(0.5)
        raise AssertionError("unreachable")

    def run(self, deployment_id: str, parameters: dict) -> dict:
        """Create a flow run of the deployment and wait for it to end; its final flow run record."""
        code, created = self.call("POST", f"/deployments/{deployment_id}/create_flow_run", {"parameters": parameters})
        assert code == 201, created

        def ended():
            _, run = self.call("GET", f"/flow_runs/{created['id']}")
            return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

        return wait_until(ended, timeout=240, interval=1, message=f"flow run {created['id']} to end")


@pytest.fixture
def stack(isolated_dirs):
    """The stack up on a free port in a temporary folder others may look into (the stack's own is 0700)."""
    base = Path(tempfile.mkdtemp(prefix="rp-stack-"))
    os.chmod(base, 0o755)
    folder = base / "stack"
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFECT_")}
    env.update({"PREFECT_PORT": str(port), "STACK_DIR": str(folder), "VENV": str(Path(sys.executable).parents[1]),
                "WORK_POOL": f"rp-stack-{uuid.uuid4().hex[:6]}"})
    try:
        up = subprocess.run([str(STACK), "up"], env=env, capture_output=True, text=True, timeout=400, check=False)
        assert up.returncode == 0, up.stdout + up.stderr + _logs(folder)
        yield {"port": port, "folder": folder, "env": env, "pool": env["WORK_POOL"], "out": up.stdout}
    finally:
        pids = [int(p.read_text()) for p in folder.glob("*.pid")]
        subprocess.run([str(STACK), "down"], env=env, capture_output=True, timeout=120, check=False)
        wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout=60, message="the stack to stop")
        shutil.rmtree(base, ignore_errors=True)


def _logs(folder: Path) -> str:
    return "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(folder.glob("*.log")))


@pytest.mark.reliability  # `make reliability` prints its rows: the routes open without the auth string among them
def test_the_stack_refuses_every_request_without_its_auth_string_and_every_job_variable_that_runs_code(
        stack, other_user, tmp_path, security_row, reliability_row):
    folder, port = stack["folder"], stack["port"]
    auth_file = folder / "auth"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    auth = auth_file.read_text()
    assert auth.startswith("resident-pool:") and len(auth) > 40 and auth not in stack["out"]
    user = Api(port, auth)
    code, deployment = user.call("GET", "/deployments/name/predict/predict")
    assert code == 200, deployment
    marker = Path(tempfile.gettempdir()) / f"rp-stack-pwned-{uuid.uuid4().hex[:8]}"
    override = {"job_variables": {"command": f"sh -c 'id > {marker}'"}}

    # Another local user: no auth string, so nothing (not even the list of deployments).
    from conftest import SYSTEM_PYTHON

    probe = ("import sys, urllib.request, urllib.error\n"
             "r = urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(), method='POST',"
             " headers={'Content-Type': 'application/json'})\n"
             "try:\n    print(urllib.request.urlopen(r, timeout=30).status)\n"
             "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    for path, body in ((f"/deployments/{deployment['id']}/create_flow_run", override), ("/deployments/filter", {})):
        done = subprocess.run(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups",
                               SYSTEM_PYTHON, "-c", probe, user.base + path, json.dumps(body)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.stdout.strip() == "401", done.stdout + done.stderr
    cat = subprocess.run(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups", "cat",
                          str(auth_file)], capture_output=True, text=True, timeout=30, check=False)
    assert cat.returncode != 0 and auth not in cat.stdout
    assert Api(port, "resident-pool:guessed").call("POST", "/deployments/filter", {})[0] == 401
    documented, answered = _documented_open_routes(), _open_routes(port)
    assert answered == documented, f"answered without the auth string: {sorted(answered)}; docs/security.md " \
        f"lists {sorted(documented)}"

    # With the auth string: no job variable that runs code, on the work pool or on a flow run.
    code, pool = user.call("GET", f"/work_pools/{stack['pool']}")
    assert code == 200 and sorted(pool["base_job_template"]["variables"]["properties"]) == [
        "labels", "name", "stream_output"], pool
    assert deployment["job_variables"] in ({}, None)
    for variables in ({"command": override["job_variables"]["command"]}, {"env": {"LD_PRELOAD": "/tmp/evil.so"}},
                      {"working_dir": str(tmp_path)}):
        # Parameters the form requires, so that the job variables are what is refused (a 409 names a parameter).
        code, said = user.call("POST", f"/deployments/{deployment['id']}/create_flow_run",
                               {"job_variables": variables, "parameters": {"provider": "echo", "payload": {"n": 1}}})
        assert code == 422 and "Additional properties are not allowed" in json.dumps(said), (variables, said)

    # The worker runs what it is given: providers from its own environment, paths only under its roots.
    ran = user.run(deployment["id"], {"provider": "echo", "payload": {"n": 1}})
    assert ran["state"]["type"] == "COMPLETED", ran["state"]["message"] + _logs(folder)
    code, screen = user.call("GET", "/deployments/name/screen/screen")
    outside = user.run(screen["id"], {"input": "/etc/passwd", "provider": "echo"})
    assert outside["state"]["type"] == "FAILED", outside["state"]
    assert "/etc/passwd: is outside" in outside["state"]["message"] and "RESIDENT_POOL_INPUT_ROOT" in \
        outside["state"]["message"], outside["state"]["message"]
    assert not marker.exists()
    security_row("another local user POSTs create_flow_run with job_variables.command; the UI user sets "
                 "command, env or working_dir, or input=/etc/passwd",
                 "401 without the auth string (0600, its folder 0700); 422 for every such variable; the "
                 "path refused naming RESIDENT_POOL_INPUT_ROOT")
    security_row("another local user calls every route of the stack's API without the auth string",
                 f"401 but the {len(documented)} routes docs/security.md lists", got="health, the UI, the schema")
    reliability_row("stack routes called without the auth string", f"401 but the {len(documented)} routes "
                    "docs/security.md lists (checked against the server's own list)")


def _documented_open_routes() -> set[str]:
    """The routes docs/security.md says answer without the auth string: its table's `GET /path` cells."""
    text = (ROOT / "docs" / "security.md").read_text()
    if "exactly these routes answer" not in text:
        return set()  # the manual lists none: every request without the auth string must then get 401
    table = text.split("exactly these routes answer", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"^\| `([A-Z]+ /[^`]*)` \|", table, re.M))


def _open_routes(port: int) -> set[str]:
    """Every route of the real server that answers a request without the auth string (anything but a 401): each of
    the API's (from its schema), with made-up ids, and the server's own pages."""
    def status(method: str, path: str) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                         data=b"{}" if method in ("POST", "PUT", "PATCH") else None,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=30) as response:
        schema = json.loads(response.read())
    routes = [(method.upper(), "/api" + path) for path, methods in schema["paths"].items() for method in methods]
    routes += [("GET", path) for path in ("/", "/ui-settings", "/docs", "/redoc", "/openapi.json")]
    assert len(routes) > 100, routes  # the whole API, not a schema that lists nothing
    made_up = str(uuid.uuid4())
    return {f"{method} {path}" for method, path in routes
            if status(method, re.sub(r"\{[^}]*\}", made_up, path)) != 401}


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
