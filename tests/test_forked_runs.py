"""Flow runs forked from the resident-process worker's zygote, as isolated as the process worker's own.

One worker (and its zygote) for the file, on the run's shared Prefect server, serving one deployment of
tests/flows/probe.py copied to a folder of its own; the tests run its flow in file order (one xdist worker takes
the file, ONE_WORKER_FILES in tests/scheduling.py). The worker runs under a tag of its own: its zygote and its
runs outlive each test on purpose, and the file's teardown checks that nothing of it is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from helpers import PREFECT, TAG_VARIABLE, describe_pids, rest_answer, tagged_processes, wait_until
from scheduling import claim_worker

from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).parent / "flows"
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DEPLOY = """
import sys
from prefect import flow
sys.path.insert(0, sys.argv[3])
from deploy import ensure_work_pool
ensure_work_pool(sys.argv[2])
remote = flow.from_source(source=sys.argv[1], entrypoint="probe.py:probe")
print(remote.deploy(name="probe", work_pool_name=sys.argv[2], print_next_steps=False))
"""


class Probe:
    """The deployment, its worker, and the REST calls the UI makes."""

    def __init__(self, api: str, folder: Path, lib: Path, log: Path, transcripts: Path, tag: str) -> None:
        self.api, self.folder, self.lib, self.log, self.transcripts, self.tag = api, folder, lib, log, transcripts, tag
        self.deployment = self.call("GET", "/deployments/name/probe/probe")["id"]
        self.count = 0

    def call(self, method: str, path: str, body: dict | None = None):
        return rest_answer(self.api, method, path, body)

    def start(self, **parameters) -> tuple[str, Path]:
        self.count += 1
        report = self.folder.parent / f"report-{self.count}.json"
        run = self.call("POST", f"/deployments/{self.deployment}/create_flow_run",
                        {"parameters": {"report": str(report), **parameters}})
        return run["id"], report

    def state(self, run_id: str) -> dict:
        return self.call("GET", f"/flow_runs/{run_id}")["state"]

    def finish(self, run_id: str, timeout: float = 120) -> dict:
        return wait_until(lambda: (state := self.state(run_id))["type"] in TERMINAL and state, timeout=timeout,
                          interval=0.1, message=f"flow run {run_id} to end")

    def run(self, **parameters) -> tuple[dict, dict, str]:
        """One flow run to its end: (its final state, its report, its id)."""
        run_id, report = self.start(**parameters)
        state = self.finish(run_id)
        assert state["type"] == "COMPLETED", (state, self.log.read_text()[-3000:])
        return state, json.loads(report.read_text()), run_id

    def logs(self, run_id: str) -> list[str]:
        found = self.call("POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200})
        return [log["message"] for log in found]

    def zygote_pid(self) -> int:
        """The current zygote: the last one the worker's transcripts name as ready."""
        def ready():
            pids = [int(line.split()[1].rstrip(":")) for path in sorted(self.transcripts.glob("zygote-flow-runs-*"))
                    for line in path.read_text().splitlines() if line.startswith("zygote ") and " preloaded " in line]
            return pids and pid_alive(pids[-1]) and pids[-1]
        return wait_until(ready, timeout=60, message="a ready flow-run zygote")


@pytest.fixture(scope="module")
def probe(prefect_harness, tmp_path_factory, request):
    """The probe deployment on a pool of its own, and one resident-process worker for it."""
    claim_worker(request, "test_forked_runs.py's worker")
    base = tmp_path_factory.mktemp("forked")
    folder, lib, logs = base / "deployment", base / "lib", base / "logs"
    shutil.copytree(PROBE, folder)
    lib.mkdir()
    (lib / "probe_lib.py").write_text("VALUE = 1\n")
    logs.mkdir(mode=0o700)
    pool = f"rp-fork-{uuid.uuid4().hex[:8]}"
    tag = os.environ[TAG_VARIABLE] + "-forked"
    env = {name: value for name, value in os.environ.items() if not name.startswith("RESIDENT_POOL_")}
    env.update({"PREFECT_API_URL": prefect_harness, "PYTHONPATH": str(lib), TAG_VARIABLE: tag,
                "RESIDENT_POOL_LOG_DIR": str(logs), "RESIDENT_POOL_STATE_DIR": str(base / "state")})
    subprocess.run([sys.executable, "-c", DEPLOY, str(folder), pool, str(ROOT / "flows")], env=env, check=True,
                   timeout=120, capture_output=True)
    log = base / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--type", "resident-process"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    try:
        started = Probe(prefect_harness, folder, lib, log, logs, tag)
        started.worker = worker
        started.zygote_pid()
        yield started
    finally:
        # Prefect's worker answers SIGTERM with a graceful stop that can take minutes; its runs are over here.
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
        wait_until(lambda: not tagged_processes(tag), timeout=30, message="the zygote to exit with its worker")
        left = tagged_processes(tag)
        assert not left, describe_pids(left)


def test_a_flow_run_that_leaks_a_thread_sets_a_variable_or_patches_a_module_leaves_nothing_for_the_next(probe):
    zygote = probe.zygote_pid()
    _, first, _ = probe.run(mischief=True)
    _, second, second_id = probe.run()
    for seen in (first, second):
        assert seen["ppid"] == zygote  # forked, not spawned
        assert seen["pid"] == seen["pgid"] == seen["sid"]  # a session of its own: a kill reaches all it started
        assert seen["cwd"] == str(probe.folder)  # the working folder its pull step chose, not the zygote's
        assert seen["retries"] == 3  # the settings of that folder's prefect.toml, read in the fork
        assert seen["zygote_env"] is False  # a name only the zygote's environment had is gone
    assert first["pid"] != second["pid"]
    assert "probe-leak" not in second["threads"] and second["leaked_env"] is None and second["patched"] is False
    # Seeds: each fork draws its own (the first run reseeded both generators to 0 as it ended).
    assert (first["random"], first["numpy"]) != (second["random"], second["numpy"])
    import random

    import numpy
    random.seed(0)
    numpy.random.seed(0)
    assert second["random"] != random.random() and second["numpy"] != float(numpy.random.random())
    # Its own log handlers: what it printed and logged went to its worker's output and to the API, not to the
    # zygote's transcript (whose stderr the console handler held at import).
    name = f"report-{probe.count}.json"
    wait_until(lambda: f"probe-print {name}" in probe.log.read_text(), timeout=10, message="the print in the log")
    assert f"probe-log {name}" in probe.log.read_text()
    wait_until(lambda: any(f"probe-log {name}" in line for line in probe.logs(second_id)), timeout=30,
               message="the run's log line in the API")
    transcripts = "".join(path.read_text() for path in probe.transcripts.glob("zygote-flow-runs-*"))
    assert "probe-print" not in transcripts and "probe-log" not in transcripts


def test_a_flow_run_that_crashes_the_interpreter_is_crashed_with_its_exit_in_words(probe):
    run_id, _ = probe.start(crash=True)
    state = probe.finish(run_id)
    assert state["type"] == "CRASHED", state
    assert "killed by SIGSEGV: a crash in native code" in state["message"], state["message"]
    probe.run()  # the zygote forks on


def test_a_cancelled_flow_run_is_cancelled_and_its_whole_process_group_killed(probe):
    run_id, report = probe.start(hang=True)
    seen = wait_until(lambda: report.exists() and json.loads(report.read_text()), timeout=60,
                      message="the hanging run to start its sleeper")
    probe.call("POST", f"/flow_runs/{run_id}/set_state", {"state": {"type": "CANCELLING", "name": "Cancelling"},
                                                          "force": True})
    state = probe.finish(run_id, timeout=90)
    assert state["type"] == "CANCELLED", state
    wait_until(lambda: not pid_alive(seen["pid"]) and not pid_alive(seen["sleeper"]), timeout=30,
               message="the run and the process it started to be gone")


def test_the_deployments_code_edited_between_runs_is_what_the_next_run_executes(probe):
    zygote = probe.zygote_pid()
    flow = probe.folder / "probe.py"
    flow.write_text(flow.read_text().replace("VERSION = 1", "VERSION = 2"))
    (probe.folder / "probe_local.py").write_text("LOCAL_VERSION = 2\n")
    _, seen, run_id = probe.run()
    assert (seen["version"], seen["local"]) == (2, 2)
    assert seen["ppid"] == zygote, probe.logs(run_id)  # the flow's own code is read afresh by each fork


def test_a_module_the_zygote_loaded_edited_or_the_zygote_killed_makes_the_next_run_spawn_and_say_why(probe):
    """A killed zygote: the next run is spawned, or, when the worker's heartbeat noticed the death first and a new
    zygote preloads within PRELOAD_WAIT_S (2.6 s in a full run, once the package stopped loading its clients at
    import), forked from that one. Either way never from the dead one, and its log says which."""
    old = probe.zygote_pid()
    stamp = (probe.lib / "probe_lib.py").stat().st_mtime_ns
    (probe.lib / "probe_lib.py").write_text("VALUE = 2\n")
    os.utime(probe.lib / "probe_lib.py", ns=(stamp + 10**9, stamp + 10**9))
    _, spawned, run_id = probe.run()
    assert spawned["lib"] == 2 and spawned["ppid"] != old
    said = wait_until(lambda: "started by plain spawn" in (text := "\n".join(probe.logs(run_id))) and text,
                      timeout=30, message="the run's log to say it was spawned")
    assert "probe_lib.py, which it loaded, changed on disk since" in said, said
    new = wait_until(lambda: (pid := probe.zygote_pid()) != old and pid, timeout=60, message="a new zygote")
    _, forked, _ = probe.run()
    assert forked["lib"] == 2 and forked["ppid"] == new

    os.kill(new, signal.SIGKILL)
    wait_until(lambda: not pid_alive(new), timeout=10, message="the zygote to die")
    _, after, run_id = probe.run()
    assert after["ppid"] not in (old, new)
    said = wait_until(lambda: any(word in (text := "\n".join(probe.logs(run_id)))
                                  for word in ("started by plain spawn", "forked from the warm zygote")) and text,
                      timeout=30, message="the run's log to say how it was started")
    if "started by plain spawn" in said:
        assert f"the zygote (pid {new}) has exited" in said, said
    else:
        assert f"forked from the warm zygote (pid {after['ppid']})" in said, said
    newest = wait_until(lambda: (pid := probe.zygote_pid()) not in (old, new) and pid, timeout=60,
                        message="a zygote after the killed one")
    assert probe.run()[1]["ppid"] == newest
