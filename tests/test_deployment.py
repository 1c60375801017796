"""Warm across flow runs, end to end: a real `prefect server`, a process worker, two deployment runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prefect_server, stop_group, wait_until

from resident_pool.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))

RUN = """
import json, sys
from prefect.deployments import run_deployment
run = run_deployment("predict/predict", parameters={"provider": "echo", "inputs": [{"n": int(sys.argv[1])}]}, timeout=240)
print(json.dumps({"state": run.state.type.value, "result": run.state.result(raise_on_failure=False)}, default=str))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_second_deployment_run_is_served_by_the_worker_the_first_started(pool_dir, tmp_path):
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with prefect_server(tmp_path) as env, open(tmp_path / "worker.log", "w") as worker_log:
        worker = None
        try:
            subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", "rp-e2e",
                            "--manifests", str(pool_dir)], env=env, check=True, cwd=ROOT, timeout=120)
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "rp-e2e", "--type", "process"], env=env,
                                      stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            runs = []
            for n in (1, 2):
                done = subprocess.run([sys.executable, "-c", RUN, str(n)], env=env, capture_output=True, text=True,
                                      timeout=300, check=False)
                assert done.returncode == 0, done.stderr[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                if n == 1:  # the first flow run's process is gone; the model worker it started is not
                    flow_run_pid, worker_pid = runs[0]["result"]["flow_run_pid"], runs[0]["result"]["worker_pid"]
                    wait_until(lambda pid=flow_run_pid: not pid_alive(pid), timeout=60,
                               message="the first flow run's process to exit")
                    assert pid_alive(worker_pid)
        finally:
            if worker is not None:
                stop_group(worker)
    first, second = (run["result"] for run in runs)
    assert [run["state"] for run in runs] == ["COMPLETED", "COMPLETED"]
    assert first["flow_run_pid"] != second["flow_run_pid"]  # two processes
    assert first["cold"] is True and second["cold"] is False
    assert second["worker_pid"] == first["worker_pid"]  # the same warm worker
    assert second["results"] == [{"echo": {"n": 2}, "pid": first["worker_pid"]}]
