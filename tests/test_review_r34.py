"""Review r34 (issue 34, the resident-process worker): probes that fail on the code as reviewed.

Each test names the finding it proves (R34-n in the review's report). The e2e ones share one resident-process
worker serving two deployments on one pool: ``alpha`` (a flow file with the kind of import-time code flow files
have: a Prometheus counter, an atexit hook, a module attribute it sets) and ``beta`` (a flow that reports what its
process sees). With Prefect's process worker, each run imports only its own flow file, once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import PREFECT, TAG_VARIABLE, configured, rest_answer, tagged_processes, wait_until
from scheduling import claim_worker

from resident_pool.host.procs import pid_alive

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")

ALPHA = textwrap.dedent("""
    import atexit
    import json
    import os

    import prometheus_client
    from prefect import flow

    RUNS = prometheus_client.Counter("review_r34_alpha_runs", "runs of alpha")  # a common top-level metric
    json.review_r34_alpha_was_here = True  # any import-time change to a shared module
    _LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "atexit.log")


    def _goodbye():
        with open(_LOG, "a") as out:
            out.write(f"{os.getpid()} {__name__}\\n")


    atexit.register(_goodbye)


    @flow
    def alpha(report: str) -> None:
        RUNS.inc()
        with open(report, "w") as out:
            json.dump({"pid": os.getpid(), "ppid": os.getppid()}, out)
""")

BETA = textwrap.dedent("""
    import json
    import os

    from prefect import flow


    @flow
    def beta(report: str) -> None:
        seen = {"pid": os.getpid(), "ppid": os.getppid(), "hash": hash("review-r34"),
                "alpha_was_here": getattr(json, "review_r34_alpha_was_here", False)}
        with open(report + ".tmp", "w") as out:
            json.dump(seen, out)
        os.replace(report + ".tmp", report)
""")

DEPLOY = """
import sys
from prefect import flow
sys.path.insert(0, sys.argv[3])
from deploy import ensure_work_pool
ensure_work_pool(sys.argv[2])
for name, folder in (("alpha", sys.argv[1] + "/alpha"), ("beta", sys.argv[1] + "/beta")):
    flow.from_source(source=folder, entrypoint=f"{name}.py:{name}").deploy(
        name=name, work_pool_name=sys.argv[2], print_next_steps=False)
"""


class Stack:
    def __init__(self, api: str, base: Path, log: Path, transcripts: Path) -> None:
        self.api, self.base, self.log, self.transcripts = api, base, log, transcripts
        self.count = 0

    def call(self, method: str, path: str, body: dict | None = None):
        return rest_answer(self.api, method, path, body)

    def start(self, name: str) -> tuple[str, Path]:
        self.count += 1
        report = self.base / f"report-{name}-{self.count}.json"
        deployment = self.call("GET", f"/deployments/name/{name}/{name}")["id"]
        run = self.call("POST", f"/deployments/{deployment}/create_flow_run", {"parameters": {"report": str(report)}})
        return run["id"], report

    def finish(self, run_id: str, timeout: float = 120) -> dict:
        return wait_until(lambda: (state := self.call("GET", f"/flow_runs/{run_id}")["state"])["type"] in TERMINAL
                          and state, timeout=timeout, interval=0.1, message=f"flow run {run_id} to end")

    def run(self, name: str) -> tuple[dict, dict | None]:
        run_id, report = self.start(name)
        state = self.finish(run_id)
        return state, (json.loads(report.read_text()) if report.exists() else None)

    def zygote_pid(self) -> int:
        def ready():
            pids = [int(line.split()[1].rstrip(":")) for path in sorted(self.transcripts.glob("zygote-flow-runs-*"))
                    for line in path.read_text().splitlines() if line.startswith("zygote ") and " preloaded " in line]
            return pids and pid_alive(pids[-1]) and pids[-1]
        return wait_until(ready, timeout=120, message="a ready flow-run zygote")


@pytest.fixture(scope="module")
def stack(prefect_harness, tmp_path_factory, request):
    claim_worker(request, "test_review_r34.py's worker")
    base = tmp_path_factory.mktemp("r34")
    logs = base / "logs"
    logs.mkdir(mode=0o700)
    for name, text in (("alpha", ALPHA), ("beta", BETA)):
        (base / name).mkdir()
        (base / name / f"{name}.py").write_text(text)
    pool = f"rp-r34-{uuid.uuid4().hex[:8]}"
    tag = os.environ[TAG_VARIABLE] + "-r34"
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("RESIDENT_POOL_") and name != "PYTHONHASHSEED"}
    env.update({"PREFECT_API_URL": prefect_harness, TAG_VARIABLE: tag, "RESIDENT_POOL_LOG_DIR": str(logs),
                "RESIDENT_POOL_STATE_DIR": str(base / "state")})
    subprocess.run([sys.executable, "-c", DEPLOY, str(base), pool, str(ROOT / "flows")], env=env, check=True,
                   timeout=180, capture_output=True)
    log = base / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", pool, "--type", "resident-process"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=base)
    try:
        started = Stack(prefect_harness, base, log, logs)
        started.zygote_pid()
        yield started
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
        try:
            wait_until(lambda: not tagged_processes(tag), timeout=30, message="the worker's processes to exit")
        finally:
            for pid in tagged_processes(tag):  # ours alone: they carry this file's tag
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_r34_1_one_deployments_import_time_patch_is_in_another_deployments_runs(stack):
    """R34-1: the zygote runs every deployment's flow file, so alpha's import-time change to a shared module is in
    every fork, beta's runs included; on the process worker beta never imports alpha."""
    zygote = stack.zygote_pid()
    state, seen = stack.run("beta")
    assert state["type"] == "COMPLETED", (state, stack.log.read_text()[-3000:])
    assert seen["ppid"] == zygote  # forked
    assert seen["alpha_was_here"] is False, "alpha's import-time json patch is in beta's flow run"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_r34_1b_one_deployments_atexit_hook_runs_at_the_end_of_another_deployments_runs(stack):
    """R34-1 (b): alpha's atexit hook, registered when the zygote preloaded alpha.py, runs at the end of every
    forked run, beta's included (and twice in alpha's own: once more for the engine's import)."""
    state, seen = stack.run("beta")
    assert state["type"] == "COMPLETED", state
    atexit_log = stack.base / "alpha" / "atexit.log"
    wait_until(lambda: not pid_alive(seen["pid"]), timeout=30, message="beta's run process to exit")
    ran = atexit_log.read_text().splitlines() if atexit_log.exists() else []
    assert not [line for line in ran if line.split()[0] == str(seen["pid"])], \
        f"alpha's atexit hook ran at the end of beta's run (pid {seen['pid']}): {ran}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_r34_2_a_flow_file_with_a_top_level_prometheus_metric_runs_as_on_the_process_worker(stack):
    """R34-2: the fork imports the flow file a second time in a process where the zygote's preload already ran
    it: a top-level Counter is a duplicate there, and the run fails (on the process worker it completes)."""
    state, _ = stack.run("alpha")
    assert state["type"] == "COMPLETED", (state["type"], state.get("message"),
                                          [line for line in stack.log.read_text().splitlines() if "Duplicated" in line])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_r34_3_forked_runs_share_their_zygotes_hash_seed_as_documented(stack):
    """R34-3: str hashes are salted once per interpreter, at its start (PYTHONHASHSEED unset), and the salt cannot
    change after (every str caches its hash, every dict holds them): the runs one zygote forks share its salt,
    where each spawned run of the process worker draws its own. A difference, so docs/prefect-ui.md says it."""
    first = stack.run("beta")[1]
    second = stack.run("beta")[1]
    assert first["ppid"] == second["ppid"]  # both forked from one zygote
    assert first["hash"] == second["hash"]
    told = " ".join((ROOT / "docs" / "prefect-ui.md").read_text().split())
    assert "string-hash seed" in told and "PYTHONHASHSEED" in told


ALPHA_V2 = textwrap.dedent("""
    import json
    import os

    from prefect import flow


    @flow
    def alpha(report: str) -> None:
        seen = {"pid": os.getpid(), "ppid": os.getppid(),
                "patched": getattr(json, "review_r34_alpha_was_here", False)}
        with open(report + ".tmp", "w") as out:
            json.dump(seen, out)
        os.replace(report + ".tmp", report)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_r34_5_a_flow_file_edited_to_drop_its_import_time_patch_runs_without_it(stack):
    """R34-5: the flow file is re-read by each fork, but what its old version did at import stays in the zygote
    (alpha.py is in no module stamp, so the zygote is not stale): the edit that removes a top-level patch is not
    what the next run executes. On the process worker the next run imports only the new file."""
    zygote = stack.zygote_pid()
    (stack.base / "alpha" / "alpha.py").write_text(ALPHA_V2)
    state, seen = stack.run("alpha")
    assert state["type"] == "COMPLETED", state
    assert seen["ppid"] == zygote  # forked from the zygote that preloaded the old alpha.py
    assert seen["patched"] is False, "the edited flow file's run still has the old file's import-time patch"


def _slow_import(tmp_path: Path, monkeypatch, seconds: int) -> Path:
    """A flow file whose one import, an installed module (on PYTHONPATH, outside the flow's folder), takes
    ``seconds``: what the zygote preloads (it runs no flow file itself)."""
    lib, flows = tmp_path / "lib", tmp_path / "flows"
    lib.mkdir()
    flows.mkdir()
    (lib / "r34_slow_import.py").write_text(f"import time\ntime.sleep({seconds})\n")
    monkeypatch.setenv("PYTHONPATH", str(lib))  # the zygotes' environment: the worker's, taken at build()
    (flows / "slow.py").write_text("import r34_slow_import\n")
    return flows / "slow.py"


@pytest.mark.slow  # real zygotes preloading Prefect: `make test`, not test-fast
@pytest.mark.timeout(180)
def test_r34_4_a_run_while_the_zygote_rebuilds_for_a_slow_flow_file_starts_at_once(tmp_path, monkeypatch):
    """R34-4: when the deployments' flow files change, the new zygote preloads their imports while fork() waits for
    it (up to start_timeout_s, 300 s): a deployment whose import is slow stalls every run of every deployment on the
    pool; a run meanwhile should be spawned (or forked by the zygote it replaces), as the issue's fallback says."""
    from resident_pool.prefect.forking import FORK_SCRIPT, FlowRunZygote
    from resident_pool.providers.zygote import ForkedProcess

    fast = tmp_path / "fast.py"
    fast.write_text("X = 1\n")
    slow = _slow_import(tmp_path, monkeypatch, 45)
    _, paths = configured()
    zygotes = FlowRunZygote(paths=paths, kill_grace_s=1.0)
    env = {"PATH": os.environ.get("PATH", ""), TAG_VARIABLE: os.environ[TAG_VARIABLE]}
    outcome: dict = {}
    thread: threading.Thread | None = None

    def fork() -> None:
        begun = time.monotonic()
        try:
            with open(os.devnull, "wb") as devnull:
                outcome["process"] = zygotes.fork([sys.executable, FORK_SCRIPT, str(tmp_path / "m.json"),
                                                   str(tmp_path)], env, devnull.fileno(), str(tmp_path))
        except Exception as exc:  # ForkRefused is an answer too: the run would be spawned
            outcome["refused"] = str(exc)
        outcome["seconds"] = time.monotonic() - begun

    try:
        zygotes.build([str(fast)])
        wait_until(lambda: zygotes._current is not None and zygotes._current.info, timeout=120,
                   message="the first zygote ready")
        zygotes.build([str(fast), str(slow)])  # a deployment added (or its file changed): a rebuild
        thread = threading.Thread(target=fork, daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), "fork() still waits after 20 s for the new zygote's 45 s preload"
        assert outcome["seconds"] < 20, outcome
    finally:
        zygotes.stop()
        if thread is not None:
            thread.join(60)
        process = outcome.get("process")
        if isinstance(process, ForkedProcess):
            process.wait(timeout=30)


@pytest.mark.slow  # real zygotes preloading Prefect: `make test`, not test-fast
@pytest.mark.timeout(120)
def test_r34_9_a_zygote_replaced_during_its_preload_is_stopped_without_a_bad_descriptor(tmp_path, monkeypatch):
    """R34-9: the flow files change while the zygote preloads (two deployments registered a heartbeat apart):
    the retired zygote is stopped under its own start, which then reads a closed socket; the operator's log
    says 'the flow-run zygote could not start: ... Bad file descriptor' and its transcript stays open."""
    from resident_pool.prefect.forking import FlowRunZygote

    one, two = _slow_import(tmp_path, monkeypatch, 3), tmp_path / "two.py"
    two.write_text("X = 2\n")
    _, paths = configured()
    zygotes = FlowRunZygote(paths=paths, kill_grace_s=1.0)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("resident_pool.prefect.forking").addHandler(handler)
    try:
        zygotes.build([str(one)])
        first = zygotes._current
        # A preload under way (its process started, its 3 s import not done): the replacement comes before it is ready.
        wait_until(lambda: first.proc is not None, timeout=30, message="the first zygote's process to start")
        assert not first.info, "the first zygote was ready before its replacement came"
        zygotes.build([str(one), str(two)])
        wait_until(lambda: zygotes._current is not None and zygotes._current.info, timeout=120,
                   message="the replacement zygote ready")
        wait_until(lambda: not zygotes._retiring, timeout=30, message="the first zygote retired")
        wait_until(lambda: first.down, timeout=30, message="the first zygote's start to end")
    finally:
        zygotes.stop()
        logging.getLogger("resident_pool.prefect.forking").removeHandler(handler)
    assert not [line for line in said if "could not start" in line], said
    assert first.transcript is not None and first.transcript._handle.closed  # its transcript is not leaked
    assert not pid_alive(first.pid)
