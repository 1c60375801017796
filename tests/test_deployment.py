"""Warm across flow runs, end to end: a real `prefect server`, a process worker, two deployment runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from helpers import wait_until
from resident_pool.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))

RUN = """
import json, sys
from prefect.deployments import run_deployment
run = run_deployment("predict/predict", parameters={"provider": "echo", "inputs": [{"n": int(sys.argv[1])}]}, timeout=240)
print(json.dumps({"state": run.state.type.value, "result": run.state.result(raise_on_failure=False)}, default=str))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_second_deployment_run_is_served_by_the_worker_the_first_started(pool_dir, tmp_path):
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / "server.log", "w") as server_log, open(logs / "worker.log", "w") as worker_log:
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                                  stdout=server_log, stderr=subprocess.STDOUT, start_new_session=True)
        worker = None
        try:
            wait_until(lambda: _healthy(f"http://127.0.0.1:{port}/api/health"), timeout=120, interval=0.5,
                       message="the Prefect server to answer")
            subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-e2e",
                            "--manifests", str(pool_dir)], env=env, check=True, cwd=ROOT, timeout=120)
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "rp-e2e", "--type", "process"], env=env,
                                      stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            runs = []
            for n in (1, 2):
                done = subprocess.run([sys.executable, "-c", RUN, str(n)], env=env, capture_output=True, text=True,
                                      timeout=300, check=False)
                assert done.returncode == 0, done.stderr[-3000:] + (logs / "worker.log").read_text()[-3000:]
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if n == 1:  # the first flow run's process is gone; the model worker it started is not
                    first = runs[0]["result"]
                    wait_until(lambda: not pid_alive(first["flow_run_pid"]), timeout=60,
                               message="the first flow run's process to exit")
                    assert pid_alive(first["worker_pid"])
        finally:
            if worker is not None:
                _stop(worker)
            _stop(server)
    first, second = (run["result"] for run in runs)
    assert [run["state"] for run in runs] == ["COMPLETED", "COMPLETED"]
    assert first["flow_run_pid"] != second["flow_run_pid"]  # two processes
    assert first["cold"] is True and second["cold"] is False
    assert second["worker_pid"] == first["worker_pid"]  # the same warm worker
    assert second["results"] == [{"echo": {"n": 2}, "pid": first["worker_pid"]}]
