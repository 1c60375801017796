"""Shared test helpers: polling, leak detection, the test worker's command."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from resident_pool.host.procs import pid_alive

PREFECT = str(Path(sys.executable).with_name("prefect"))

WORKERS = Path(__file__).parent / "workers"
TEST_WORKER = WORKERS / "testworker.py"
TAG_VARIABLE = "RESIDENT_POOL_TEST_TAG"
# Processes a wider-scoped fixture keeps across tests on purpose; the per-test leak check skips them.
LONG_LIVED: set[int] = set()


# Runs a test twice: its workers spawned, then forked from a zygote (the conftest's `way` fixture).
both_ways = pytest.mark.parametrize("way", ["spawn", "zygote"], indirect=True)


def wait_until(condition, timeout=10.0, interval=0.02, message="condition"):
    """Poll ``condition`` until it returns truthy; return that value or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)



def rest_call(url: str, method: str, path: str, body: object = None, auth: str | None = None) -> tuple[int, object]:
    """One call to a Prefect server's REST API (``url`` ends in /api): its status and decoded body, whatever the
    status. ``auth`` is sent as the stack's UI and Prefect's client send it (HTTP Basic, the string base64-encoded
    whole). A 503 (the server's SQLite busy on a loaded machine, seen in full runs) is asked again, 20 times at
    most half a second apart, as Prefect's own client does."""
    headers = {"content-type": "application/json"}
    if auth is not None:
        headers["authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(20):
        request = urllib.request.Request(url + path, method=method, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            if error.code != 503 or attempt == 19:
                text = error.read().decode(errors="replace")
                try:
                    return error.code, json.loads(text or "null")
                except ValueError:
                    return error.code, text
        time.sleep(0.5)
    raise AssertionError("unreachable")


def rest_answer(url: str, method: str, path: str, body: object = None, auth: str | None = None):
    """``rest_call``'s body where the call succeeded; otherwise an AssertionError with the server's own words (a
    409 names the bad parameter)."""
    status, answer = rest_call(url, method, path, body, auth)
    if status >= 400:
        raise AssertionError(f"{method} {path}: {status} {json.dumps(answer) if not isinstance(answer, str) else answer}")
    return answer

def configured():
    """The settings as this test's environment gives them now, and the folders they name: what an edge (the CLI,
    ``Pool()``, the daemon) reads and hands down."""
    from resident_pool.host.paths import Paths
    from resident_pool.settings import settings

    config = settings()
    return config, Paths.of(config)


def as_the_pool() -> dict:
    """``config=`` and ``paths=`` for a start planned as the pool plans it, from this test's settings."""
    config, paths = configured()
    return {"config": config, "paths": paths}


def state_dir() -> Path:
    """This test's state folder (made private), as its settings name it."""
    return configured()[1].state_dir()


def run_folder(config) -> Path:
    """The folder every process of this pytest run shares: the base temp folder, or its parent under xdist (each
    worker has its own base inside it)."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


# Folders whose fixtures are done with them: (folder, session, the session's failures when it was made).
_RELEASED: list[tuple[str, pytest.Session, int]] = []


@contextmanager
def short_folder(request, prefix: str):
    """A new folder under the system's temp folder (short: AF_UNIX socket paths must fit in 107 bytes).

    Removed once the test that released it is over, setup to teardown, unless a test of this process failed
    meanwhile: a failure's transcripts and logs stay to be read (the leak check fails a test in its teardown,
    after the fixtures that made its folders are gone). The suite used to leave two folders per test in /tmp.
    """
    failed_before = request.session.testsfailed
    folder = tempfile.mkdtemp(prefix=prefix)
    try:
        yield folder
    finally:
        _RELEASED.append((folder, request.session, failed_before))


def remove_released_folders() -> None:
    """The folders released so far go, each unless a test failed since it was made (conftest calls this once a
    test's teardown is over, and failures in it counted)."""
    while _RELEASED:
        folder, session, failed_before = _RELEASED.pop()
        if session.testsfailed == failed_before:
            shutil.rmtree(folder, ignore_errors=True)


def settled_task_runs(flow_state, count: int, timeout: float = 30.0) -> list:
    """The flow run's ``count`` task runs, once each is recorded in a final state.

    Prefect 3 records a task run from the events its engine sends, so a read made right after the flow returns can
    find a run missing or still Running (run_count 1 after a retry that has already succeeded)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flow_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))

    def recorded():
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=flow_run)
        return runs if len(runs) == count and all(run.state and run.state.is_final() for run in runs) else None

    return wait_until(recorded, timeout=timeout, interval=0.1,
                      message=f"{count} task run(s) of flow run {flow_state.state_details.flow_run_id} in a final state")


def wait_listening(socket_path: str, process: subprocess.Popen, timeout: float = 30.0) -> None:
    """Wait until ``process`` accepts connections on the Unix socket at ``socket_path`` (or has exited).

    The socket's file exists from bind(); a connect before the listen() that follows it is refused."""
    def accepting():
        if process.poll() is not None:
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(socket_path)
            except OSError:
                return False
        return True

    wait_until(accepting, timeout=timeout, message=f"a listener on {socket_path}")


def tagged_processes(tag: str) -> list[int]:
    """Live pids (not this one) whose environment carries this run's tag."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def describe_pids(pids) -> str:
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {command}")
        except OSError:
            lines.append(f"{pid}: (gone)")
    return "\n".join(lines)


def worker_command(*options, python=sys.executable, env=None):
    """A build_command for ResidentWorker that runs the test worker with ``options``."""

    def build(worker):
        return [python, str(TEST_WORKER), worker.socket_path, *options], dict(env or {})

    return build


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM a process started with start_new_session, and its children; SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_pool_in(state_dir: str) -> None:
    """Shut down the pool serving ``state_dir`` if one does, and wait for it to be gone."""
    from resident_pool.client import Pool
    from resident_pool.host.procs import pid_alive

    pid_file = Path(state_dir, "pool.pid")
    if not Path(state_dir, "pool.sock").exists():
        return
    previous = os.environ.get("RESIDENT_POOL_STATE_DIR")
    os.environ["RESIDENT_POOL_STATE_DIR"] = state_dir
    try:
        Pool(start=False).shutdown()
    except (OSError, ValueError, RuntimeError):
        pass  # already gone
    except Exception as exc:
        print(f"shutting down the pool in {state_dir}: {exc}")
    finally:
        if previous is None:
            os.environ.pop("RESIDENT_POOL_STATE_DIR", None)
        else:
            os.environ["RESIDENT_POOL_STATE_DIR"] = previous
    if pid_file.exists():
        pid = int(pid_file.read_text())
        wait_until(lambda: not pid_alive(pid), timeout=60, message=f"pool {pid} to exit")


class RefusingClient:
    """A pool client whose every lease is refused with ``error``, as a pool with an open breaker refuses."""

    def __init__(self, error, manifests):
        self.error, self.manifests, self.on_wait = error, manifests, None
        self.config, self.paths = configured()  # what a failure's artifact is written with

    def session(self, slug, holder=None, **options):  # options: what pool_session passes (max_attachment_bytes)
        raise self.error

    def waiting(self):  # the pool's waiting line, which a screen's progress shows: nothing waits here
        return []


def breaker_open(slug="kernels", transcript="/tmp/kernels-0.log"):
    """A request refused by an open breaker, as the pool sends it: reason breaker_open, the original beside it."""
    from resident_pool.errors import ResidentPoolError, WorkerStartError

    original = WorkerStartError(f"{slug}: the worker exited before it answered (exit code 3)", slug=slug,
                                exit_code=3, transcript=transcript,
                                transcript_tail=["loading", "REFUSED: no licence for this GPU"],
                                details={"breaker_opened": True})
    return ResidentPoolError(f"{slug}: not started: its breaker is open", slug=slug, reason="breaker_open",
                             details={"breaker": {"failures": 1, "closes_in_s": 157.4}, "original": original.to_dict()})


def read_fasta(path: Path) -> dict[str, str]:
    """Each record's id (its header's first word) and sequence: the tests' own reading, apart from the product's."""
    found: dict[str, str] = {}
    name = None
    for line in Path(path).read_text().splitlines():
        if line.startswith(">"):
            name = line[1:].split()[0]
            found[name] = ""
        elif name is not None:
            found[name] += line.strip()
    return found


def load_minilm_worker(name: str):
    """The demo provider's worker script (manifests/minilm/worker.py) as a module of this process, under ``name``:
    its tokenizing and its model called directly, without a pool."""
    path = Path(__file__).resolve().parents[1] / "manifests" / "minilm" / "worker.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
