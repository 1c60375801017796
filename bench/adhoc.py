"""Ad hoc runs from the UI: the resident-process worker against Prefect's process worker, same deployment, one run.

A real `prefect server`, the project's deployments registered once (flows/deploy.py), and one worker at a time on
their pool: Prefect's process worker with its defaults, the same with PREFECT_WORKER_QUERY_SECONDS=1 (so the gain
shown is more than a shorter poll), then the resident-process worker. Each flow run is created as the UI creates
one (POST create_flow_run with the form's parameters) and timed to the moment its answer artifact exists. Cold: the
first run after the worker starts, the resident pool stopped before (the model loads too, as after
`make stack-up`). Warm: 10 runs after it. A screen of the shipped FASTA, started the same way, on each worker.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "MSEQNNTEMTFQIQRIYTKDISFEAPNAPHVFQ", "MALWMRLLPLLALLALWGPDPAAA"]
WARM_RUNS = 10
POOL = "bench-adhoc"
# A screen that gives no answer within this fails its row, with the reason, and the case goes on.
SCREEN_TIMEOUT_S = 300.0
# In the environment of every process the case starts (the server, workers, flow runs and what they start: the
# pool daemon and its model workers), so that all of them are ended on any exit (``end_tagged``).
TAG_VARIABLE = "RESIDENT_POOL_BENCH_ADHOC_TAG"


def tagged_processes(tag: str) -> list[int]:
    """Live pids (not this one) whose environment carries ``TAG_VARIABLE=tag``."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def end_tagged(tag: str, timeout: float = 30.0, spare: int | None = None) -> list[int]:
    """SIGKILL every process that carries ``tag`` (but ``spare``), and the process group of each that leads one (a
    flow run's session, the engine it spawned); the pids it found."""
    ours = os.getpgid(0)
    found: list[int] = []
    deadline = time.monotonic() + timeout
    while (pids := [pid for pid in tagged_processes(tag) if pid != spare]) and time.monotonic() < deadline:
        found.extend(pid for pid in pids if pid not in found)
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group == pid and group != ours:
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        time.sleep(0.1)
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Api:
    """The server's REST API as the UI calls it (a 503 from a busy SQLite is asked again, as Prefect's client does)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def call(self, method: str, path: str, body: dict | None = None):
        for attempt in range(40):
            request = urllib.request.Request(self.url + path, method=method,
                                             headers={"content-type": "application/json"},
                                             data=None if body is None else json.dumps(body).encode())
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return json.loads(response.read() or b"null")
            except urllib.error.HTTPError as error:
                if error.code != 503 or attempt == 39:
                    raise
            time.sleep(0.25)
        return None

    def wait_for(self, run_id: str, key: str | None, timeout: float = 600) -> float:
        """Seconds until the run's artifact ``key`` exists (``key`` None: until the run completes); a run that ends
        otherwise fails the case."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if key is not None:
                found = self.call("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
                if any(artifact["key"] == key for artifact in found):
                    return time.perf_counter()
            state = self.call("GET", f"/flow_runs/{run_id}")["state"]
            if state["type"] == "COMPLETED" and key is None:
                return time.perf_counter()
            if state["type"] in ("FAILED", "CRASHED", "CANCELLED"):
                raise RuntimeError(f"flow run {run_id} ended {state['type']}: {state.get('message')}")
            time.sleep(0.05)
        raise TimeoutError(f"flow run {run_id} gave no answer within {timeout:g} s")


class AnswersError(Exception):
    """A screen of the shipped file completed with answers that do not mean what they should."""


def check_demo_answers(output: Path) -> None:
    """The whole demo file's answers, as the suite checks only its first ones (tests/test_ui.py): one ok record per
    protein, none read as unknown tokens, and a distinct embedding for each distinct sequence (the file holds 498)."""
    records = [json.loads(line) for line in output.read_text().splitlines()]
    bad = [r.get("id") for r in records if not r.get("ok") or r.get("unknown_tokens") != 0]
    distinct = len({r.get("embedding_f32") for r in records})
    if len(records) != 500 or bad or distinct != 498:
        raise AnswersError(f"{output}: {len(records)} records (500 expected), {len(bad)} failed or with unknown "
                           f"tokens (first: {bad[:3]}), {distinct} distinct embeddings (498 expected)")


class Stack:
    """The server and the deployments; one worker at a time."""

    def __init__(self, env, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex
        port = _free_port()
        self.env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_API_URL":
                    f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "RESIDENT_POOL_INPUT_ROOT": str(ROOT / "data"), "RESIDENT_POOL_OUTPUT_ROOT": str(tmp),
                    TAG_VARIABLE: self.tag}
        self.worker: subprocess.Popen | None = None
        self.server_log = open(tmp / "server.log", "w")  # noqa: SIM115 - open for the server's life
        self.server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                       env=self.env, stdout=self.server_log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            self._deploy(env)
        except BaseException:
            self.close()
            raise

    def _deploy(self, env) -> None:
        tmp = self.tmp
        self.api = Api(self.env["PREFECT_API_URL"])
        deadline = time.monotonic() + 300
        while True:
            try:
                self.api.call("GET", "/health")
                break
            except OSError:
                if time.monotonic() > deadline or self.server.poll() is not None:
                    raise RuntimeError(f"the Prefect server did not start; see {tmp / 'server.log'}") from None
                time.sleep(0.5)
        subprocess.run([sys.executable, str(ROOT / "flows" / "deploy.py"), "--work-pool", POOL, "--manifests",
                        str(env.manifests), "--paused", "--validate-schedule", ""], env=self.env, check=True,
                       cwd=ROOT, timeout=300, capture_output=True)
        self.predict = self.api.call("GET", "/deployments/name/predict/predict")["id"]
        self.screen = self.api.call("GET", "/deployments/name/screen/screen")["id"]

    def start_worker(self, kind: str, name: str, **extra: str) -> None:
        """A worker of ``kind`` on the pool, returned once it says it started."""
        log = self.tmp / f"worker-{name}.log"
        env = {**self.env, **extra, "RESIDENT_POOL_RESULTS_DIR": str(self.tmp / f"results-{name}")}
        with open(log, "w") as out:
            self.worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", POOL, "--type", kind], env=env,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + 120
        while "started!" not in log.read_text():
            if time.monotonic() > deadline or self.worker.poll() is not None:
                raise RuntimeError(f"the {kind} worker did not start; see {log}")
            time.sleep(0.05)

    def stop_worker(self) -> None:
        """Killed, group and all: Prefect's worker answers SIGTERM with a stop that can take minutes. A
        resident-process worker's zygote exits as its channel closes. A run still going (a screen past its
        timeout) would hold the model through the next worker's runs: it is ended too, with the pool it used,
        everything the case started but the server."""
        from resident_pool.client import shutdown_pool

        if self.worker is not None:
            os.killpg(self.worker.pid, signal.SIGKILL)
            self.worker.wait(timeout=30)
            self.worker = None
            shutdown_pool(wait_s=30)
            end_tagged(self.tag, spare=self.server.pid)

    def predict_once(self) -> float:
        started = time.perf_counter()
        run = self.api.call("POST", f"/deployments/{self.predict}/create_flow_run", {"parameters": {
            "provider": "minilm", "sequences": SEQUENCES, "payload": None, "priority": "interactive"}})
        return self.api.wait_for(run["id"], "predict-minilm") - started

    def screen_once(self, name: str, timeout: float = SCREEN_TIMEOUT_S) -> float:
        """Seconds from create_flow_run to Completed for a screen of the shipped file; its answers are checked for
        meaning, not only counted (AnswersError otherwise)."""
        started = time.perf_counter()
        output = self.tmp / f"screen-{name}.jsonl"
        run = self.api.call("POST", f"/deployments/{self.screen}/create_flow_run", {"parameters": {
            "input": str(ROOT / "data" / "uniprot-500.fasta"), "provider": "minilm", "output": str(output)}})
        seconds = self.api.wait_for(run["id"], None, timeout=timeout) - started
        check_demo_answers(output)
        return seconds


    def close(self) -> None:
        """Everything the case started ended, on any exit: the worker's group, the pool the flow runs started (asked
        to shut down, its model workers with it), the server, then every process still carrying the case's tag (a
        flow run in a session of its own, the engine a process worker spawned, a worker a dead pool left)."""
        from resident_pool.client import shutdown_pool

        try:
            self.stop_worker()
            shutdown_pool(wait_s=30)  # a pool started by a run of a worker that failed to start
            if self.server.poll() is None:
                os.killpg(self.server.pid, signal.SIGTERM)
                try:
                    self.server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(self.server.pid, signal.SIGKILL)
                    self.server.wait()
        finally:
            left = end_tagged(self.tag)
            self.server_log.close()
            if left:
                print(f"    ended {len(left)} process(es) the case left running: {left}", flush=True)


ARMS = {  # row name -> (worker type, its extra environment)
    "process worker (defaults)": ("process", {}),
    "process worker (PREFECT_WORKER_QUERY_SECONDS=1)": ("process", {"PREFECT_WORKER_QUERY_SECONDS": "1"}),
    "ours": ("resident-process", {}),
}


def case_adhoc_predict(table, env, quick: bool) -> None:
    """Warm and cold ad hoc predicts of three sequences, and a screen of the shipped file, on each worker."""
    from resident_pool.client import shutdown_pool

    tmp = env.tmp / "adhoc"
    tmp.mkdir()
    stack = Stack(env, tmp)
    warm_runs = 3 if quick else WARM_RUNS
    cold: dict[str, float] = {}
    warm: dict[str, list[float]] = {}
    screens: dict[str, float] = {}
    screen_failures: dict[str, str] = {}
    try:
        for name, (kind, extra) in ARMS.items():
            slug = "".join(c if c.isalnum() else "-" for c in name)
            shutdown_pool()  # cold: the model loads in this run too, as after `make stack-up`
            stack.start_worker(kind, slug, **extra)
            cold[name] = stack.predict_once()
            warm[name] = [stack.predict_once() for _ in range(warm_runs)]
            if name != "process worker (PREFECT_WORKER_QUERY_SECONDS=1)":
                try:
                    screens[name] = stack.screen_once(slug)
                except (TimeoutError, AnswersError) as exc:  # this row fails with the reason, the case goes on
                    screen_failures[name] = str(exc)
            stack.stop_worker()
            print(f"    {name}: cold {cold[name]:.2f} s, warm p50 {statistics.median(warm[name]):.2f} s"
                  + (f", screen {screens[name]:.1f} s" if name in screens else "")
                  + (f", screen failed: {screen_failures[name]}" if name in screen_failures else ""), flush=True)
    finally:
        stack.close()
        shutil.rmtree(tmp / "prefect-home", ignore_errors=True)
    case = "ad hoc predict (UI)"
    ours, default, short = (statistics.median(warm[name]) for name in
                            ("ours", "process worker (defaults)", "process worker (PREFECT_WORKER_QUERY_SECONDS=1)"))
    for name in ARMS:
        table.add(case, f"warm p50, {name}", statistics.median(warm[name]), "s", "", None,
                  note=f"create_flow_run to answer artifact, {len(warm[name])} runs, 3 sequences, minilm")
    table.add(case, "warm: ours / process worker (defaults)", ours / default, "x", "<= 0.2", ours / default <= 0.2)
    table.add(case, "warm: ours / process worker (query 1 s)", ours / short, "x", "<= 0.4", ours / short <= 0.4)
    for name in ("process worker (defaults)", "ours"):
        table.add(case, f"cold, {name}", cold[name], "s", "", None,
                  note="first run after the worker started, the resident pool stopped before")
    ratio = cold["ours"] / cold["process worker (defaults)"]
    table.add(case, "cold: ours / process worker (defaults)", ratio, "x", "<= 0.5", ratio <= 0.5)
    for name, seconds in screens.items():
        table.add(case, f"screen of uniprot-500.fasta, {name}", seconds, "s", "", None,
                  note="create_flow_run to Completed")
    if screen_failures:
        table.add(case, "screen: ours / process worker (defaults)", float("nan"), "x", "<= 1", False,
                  note="; ".join(f"{name}: {why}" for name, why in screen_failures.items()))
        return
    ratio = screens["ours"] / screens["process worker (defaults)"]
    table.add(case, "screen: ours / process worker (defaults)", ratio, "x", "<= 1", ratio <= 1)
