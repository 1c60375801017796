"""A campaign spread over three simulated GPU hosts with prefect-dask's DaskTaskRunner.

Each host is one `dask worker` process with its own resident-pool state and log
directories, so its own pool: the layout of a rack of GPU hosts, on one machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import stop_group, wait_until
from providers import write_provider

from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
DASK = str(Path(sys.executable).with_name("dask"))
sys.path.insert(0, str(ROOT / "flows"))
pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


def _host_env(base: Path, name: str) -> dict[str, str]:
    host = base / name
    return {**os.environ,
            "RESIDENT_POOL_STATE_DIR": str(host / "state"), "RESIDENT_POOL_LOG_DIR": str(host / "logs"),
            "RESIDENT_POOL_ORPHAN_GRACE_S": "1", "RESIDENT_POOL_HEARTBEAT_STALE_S": "2",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "flows"), str(ROOT / "tests"), str(ROOT)])}


@pytest.mark.timeout(600)
def test_three_hosts_each_start_the_provider_once_and_a_killed_host_loses_nothing(pool_dir, tmp_path, short_tmp):
    pytest.importorskip("prefect_dask", reason="prefect-dask is not installed (pip install -e .[prefect])")
    from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
    from prefect_dask import DaskTaskRunner
    from screen import screen

    write_provider(pool_dir, "embedder", "[lifecycle]\nmax_replicas = 1\n", worker="embedder.py")
    inputs = tmp_path / "inputs.jsonl"
    # Distinct sequences: the campaign computes a repeated sequence once, and this test needs 600 computations.
    inputs.write_text("".join(json.dumps({"id": f"s{n}", "sequence": f"MKV{n}"}) + "\n" for n in range(600)))
    output = tmp_path / "out.jsonl"
    # Short, like the runtime folders real hosts use: a worker's socket path must fit AF_UNIX's 107 bytes.
    hosts = short_tmp
    scheduler_file = tmp_path / "scheduler.json"
    procs = []
    try:
        procs.append(subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                       "--scheduler-file", str(scheduler_file)], start_new_session=True,
                                      env=_host_env(hosts, "scheduler"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_until(scheduler_file.exists, timeout=60, message="the Dask scheduler")
        workers = {}
        for n in range(3):
            name = f"host-{n}"
            workers[name] = subprocess.Popen(
                [DASK, "worker", "--scheduler-file", str(scheduler_file), "--name", name, "--nthreads", "2",
                 "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"],
                env=_host_env(hosts, name), start_new_session=True, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            procs.append(workers[name])
        address = json.loads(scheduler_file.read_text())["address"]

        def hosts_up():
            from distributed import Client

            with Client(address, timeout=10) as client:
                return len(client.scheduler_info()["workers"]) == 3

        wait_until(hosts_up, timeout=120, interval=0.5, message="three Dask workers")

        def kill_host_1():
            # Once a third of the campaign is written, host-1 dies whole: worker, pool, model.
            partial = output.with_name(output.name + ".partial")  # results land there as chunks finish
            wait_until(lambda: output.exists() or (partial.exists() and len(partial.read_text().splitlines()) >= 200),
                       timeout=300, message="a third of the campaign")
            pool_pid = int((hosts / "host-1" / "state" / "pool.pid").read_text())
            os.kill(pool_pid, signal.SIGKILL)
            os.killpg(workers["host-1"].pid, signal.SIGKILL)

        import threading

        killer = threading.Thread(target=kill_host_1)
        killer.start()
        runner = DaskTaskRunner(address=address)
        with temporary_settings({PREFECT_LOCAL_STORAGE_PATH: tmp_path / "results"}):
            summary = screen.with_options(task_runner=runner)(
                input=str(inputs), provider="embedder", chunk_size=10, output=str(output))
        killer.join(timeout=60)
    finally:
        for proc in reversed(procs):
            stop_group(proc)
        for name in ("host-0", "host-1", "host-2"):  # the surviving hosts' pools
            pid_file = hosts / name / "state" / "pool.pid"
            if pid_file.exists() and pid_alive(int(pid_file.read_text())):
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(600))  # every input, once
    failures = sorted({f"{r['reason']}: {r.get('error', '')[:300]}" for r in records if not r["ok"]})
    assert summary["ok"] == 600 and summary["missing"] == 0, failures[:5]
    for name in ("host-0", "host-1", "host-2"):
        starts = list((hosts / name / "logs").glob("embedder-*.log"))
        assert len(starts) <= 1, f"{name} started the provider {len(starts)} times"
    working = [name for name in ("host-0", "host-1", "host-2") if list((hosts / name / "logs").glob("embedder-*.log"))]
    assert len(working) >= 2  # the campaign really spread over hosts
    for name in ("host-0", "host-2"):
        pid_file = hosts / name / "state" / "pool.pid"
        if pid_file.exists():
            pool_pid = int(pid_file.read_text())
            wait_until(lambda pid=pool_pid: not pid_alive(pid), timeout=30, message=f"{name}'s pool")
