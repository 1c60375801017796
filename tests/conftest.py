from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from helpers import (
    LONG_LIVED,
    TAG_VARIABLE,
    TEST_WORKER,
    configured,
    describe_pids,
    remove_released_folders,
    run_folder,
    short_folder,
    stop_pool_in,
    tagged_processes,
    wait_until,
)
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

# Property tests judge answers, never time: Hypothesis' default deadline (200 ms an example) and its too-slow health
# check are absolute times, which the suite leaves to bench/. On this 2-core machine under the whole suite, a property
# test of test_golden.py failed twice in two stops and passed alone each time (its output was not kept).
hypothesis_settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
hypothesis_settings.load_profile("suite")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n N: each file of ONE_WORKER_FILES to one worker, whole (scheduling.py says why not xdist's)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):  # load: plain `pytest -n 4`
        return None
    from scheduling import OneWorkerPerListedFile

    return OneWorkerPerListedFile(config, log)


# Every process the suite starts inherits this tag, so the leak check can
# find them even after they were reparented.
TAG = uuid.uuid4().hex
os.environ[TAG_VARIABLE] = TAG
# `make test` runs 4 test processes on 2 cores: each model worker gets one thread (the pool passes a thread limit on
# to its workers, as an operator's on a shared host), not torch's default of one per core, whose threads spun waiting
# for cores the other tests held. `make run` and `make bench` run the demo with torch's default.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The test harness's server must not try to phone home from an offline machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The host's own admission service and its configuration are never the suite's: a test that wants one starts its
# own. Set here, before any fixture, so a module- or session-scoped one (and every process it starts) has them too;
# each test then points the configuration at a file of its own folder (isolated_dirs).
os.environ["RESIDENT_POOL_ADMISSION_SERVICE"] = "off"
os.environ["RESIDENT_POOL_ADMISSION_CONFIG"] = os.path.join(os.sep, "nonexistent", "resident-pool-suite",
                                                            "admission.toml")


@pytest.fixture(autouse=True)
def isolated_dirs(monkeypatch, no_leaked_processes, request):  # the leak check runs after the pool is shut down
    """A private state and log directory per test; short, for AF_UNIX paths; removed after a test that passed.

    A pool something in the test started there (a client, `resident-pool check`) is shut down after.
    """
    with short_folder(request, "rp-") as state, short_folder(request, "rp-logs-") as logs:
        monkeypatch.setenv("RESIDENT_POOL_STATE_DIR", os.path.join(state, "s"))
        monkeypatch.setenv("RESIDENT_POOL_LOG_DIR", logs)
        # Campaign results too: a test must not be answered from another test's (or the user's) result store.
        monkeypatch.setenv("RESIDENT_POOL_RESULTS_DIR", os.path.join(state, "results"))
        # Never the host's admission service (/etc/resident-pool, /run/resident-pool): `off` is what `auto` gives on
        # a host without one, and its configuration file is the test's own (absent). A service's tests set theirs.
        monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", "off")
        monkeypatch.setenv("RESIDENT_POOL_ADMISSION_CONFIG", os.path.join(state, "admission.toml"))
        yield {"state": os.path.join(state, "s"), "logs": logs, "results": os.path.join(state, "results")}
        stop_pool_in(os.path.join(state, "s"))


def pytest_runtest_logfinish(nodeid, location):
    """The test is over, its teardown's failures counted: its short folders go, or stay if it failed."""
    remove_released_folders()


@pytest.fixture
def short_tmp(request):
    """A folder under the system's temp folder, short for AF_UNIX paths; removed after a test that passed."""
    with short_folder(request, "rp-t-") as folder:
        yield Path(folder)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Fail a test that leaves a process of its own running (and kill it).

    Processes that were running before the test (a session-wide Prefect
    server) are not the test's.
    """
    before = set(tagged_processes(TAG))
    yield

    def leftovers():
        # multiprocessing's resource tracker serves this pytest process for its whole life
        # (a ProcessPoolTaskRunner starts it once); it exits with pytest.
        return [pid for pid in tagged_processes(TAG)
                if pid not in before and pid not in LONG_LIVED
                and "multiprocessing.resource_tracker" not in describe_pids([pid])]

    try:
        wait_until(lambda: not leftovers(), timeout=10, message="the test's processes to exit")
    except AssertionError:
        leaked = leftovers()
        report = describe_pids(leaked)
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"processes left running after the test:\n{report}")


@pytest.fixture
def way(request):
    """How workers start: "spawn" (the default), or "zygote" (forked) in a test marked ``@both_ways``."""
    return getattr(request, "param", "spawn")


@pytest.fixture
def workers(way):
    """Make ResidentWorkers that are closed when the test ends; forked from a zygote when ``way`` says so."""
    from resident_pool import ResidentWorker
    from resident_pool.providers.zygote import Zygote

    made = []
    config, paths = configured()
    zygote = Zygote("testworker", "tests", sys.executable, {}, str(TEST_WORKER), ["json", "ctypes"], paths=paths,
                    kill_grace_s=config.kill_grace_s) if way == "zygote" else None

    def make(slug="testworker", build_command=None, **kwargs):
        worker = ResidentWorker(slug, build_command, spawner=zygote, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.close()
    if zygote is not None:
        zygote.stop()
        # Forked, every one: a silent fall back to spawning would make the zygote run prove nothing.
        assert zygote.forks == sum(worker.starts for worker in made), zygote.failure


@pytest.fixture
def pool_dir(tmp_path, monkeypatch, isolated_dirs):
    """A manifests folder for pool tests; any pool started against it is shut down afterwards."""
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    monkeypatch.setenv("RESIDENT_POOL_MANIFESTS", str(manifests))
    monkeypatch.setenv("RESIDENT_POOL_QUIET_EXIT_S", "120")  # a pool a test forgot still leaves
    monkeypatch.setenv("RESIDENT_POOL_GPU_HEADROOM_GB", "0")
    yield manifests
    stop_pool_in(isolated_dirs["state"])


@pytest.fixture(scope="session")
def prefect_harness(request):
    """The run's one Prefect server (started at collection, shared by every xdist worker): flows and clients of
    this worker, and the subprocesses its tests start, talk to it."""
    from prefect.context import _temporary_global_settings_context, get_settings_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = _SHARED_PREFECT.get("url") or _start_shared_prefect(request.config)
    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url  # subprocesses a test starts (a flow run, a CLI) reach it too
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}), \
                _temporary_global_settings_context(get_settings_context()):
            yield url
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous


_SHARED_PREFECT: dict = {}


def _start_shared_prefect(config, wait: bool = True) -> str:
    """Start the run's Prefect server, or join the one another worker started; the last worker stops it.

    An xdist worker starts (or joins) it as it is configured, without waiting, so that the server boots while the
    workers collect; each waits for it once its collection is done (``wait``), where no test's timeout runs: a
    first start (the database's migrations) can take a minute on a busy 2-core machine.
    """
    import json
    import subprocess

    from filelock import FileLock

    root = run_folder(config)
    info, lock = root / "prefect-server.json", FileLock(str(root / "prefect-server.lock"))
    with lock:
        shared = json.loads(info.read_text()) if info.exists() else None
        if shared is None:
            port = _free_port()
            env = {**os.environ, "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{root / 'prefect.db'}"}
            env.pop("PREFECT_API_URL", None)
            env.pop(TAG_VARIABLE, None)  # the run's, not one test's: no per-test leak check counts it
            with open(root / "prefect-server.log", "ab") as log:
                proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host",
                                         "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=log,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            shared = {"url": f"http://127.0.0.1:{port}/api", "pid": proc.pid, "users": 0}
            _SHARED_PREFECT["process"] = proc  # kept: a Popen collected while it runs warns, and warnings fail
        shared["users"] += 1
        info.write_text(json.dumps(shared))

    def leave() -> None:
        process = _SHARED_PREFECT.get("process")
        with lock:
            now = json.loads(info.read_text())
            now["users"] -= 1
            last = now["users"] == 0
            if last:
                info.unlink()
            else:
                info.write_text(json.dumps(now))
        if last:
            try:
                os.killpg(now["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        if process is not None:  # the worker that started it reaps it, once the last to leave has stopped it
            process.wait(timeout=30 if last else 1800)

    config.add_cleanup(leave)
    _SHARED_PREFECT["url"], _SHARED_PREFECT["pid"] = shared["url"], shared["pid"]
    _SHARED_PREFECT["log"] = root / "prefect-server.log"
    if wait:
        _await_shared_prefect()
    return shared["url"]


def _await_shared_prefect() -> None:
    """Wait until the run's Prefect server answers; fail, with its log's tail, if it exited instead."""
    from resident_pool.host.procs import pid_alive

    url, pid = _SHARED_PREFECT["url"], _SHARED_PREFECT["pid"]
    wait_until(lambda: _healthy(url) or not pid_alive(pid), timeout=300, interval=0.1,
               message="the shared Prefect server to answer")
    assert _healthy(url), f"the shared Prefect server (pid {pid}) exited:\n" + \
        _SHARED_PREFECT["log"].read_text()[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


RELIABILITY_ROWS: list[dict] = []
SECURITY_ROWS: list[dict] = []


@pytest.fixture
def reliability_row(request):
    """Record a row of the reliability table `make reliability` prints (fault, what the caller saw, counts).

    Carried on the test's report, so the table prints whether the tests ran here or in xdist workers.
    """

    def record(fault, seen, lost=0, leaked=0, **figures):
        request.node.user_properties.append(
            ("reliability_row", {"fault": fault, "seen": seen, "lost": lost, "leaked": leaked, **figures}))

    return record


@pytest.fixture
def security_row(request):
    """Record a row of the security block `make reliability` prints: the attack, its outcome, what it got."""

    def record(attack, outcome, got="nothing"):
        request.node.user_properties.append(("security_row", {"attack": attack, "outcome": outcome, "got": got}))

    return record


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for name, row in report.user_properties:
        if name == "reliability_row":
            RELIABILITY_ROWS.append(row)
        elif name == "security_row":
            SECURITY_ROWS.append(row)


# Tests that start real pools, Prefect servers, browsers or stacks: the fast tier (`make test-fast`) leaves them out.
E2E_FIXTURES = {"pool_dir", "prefect_harness", "workers", "engines", "other_user", "stack"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(trylast=True)  # after the temporary folders' own configure: the run's folder holds its state
def pytest_configure(config):
    """An xdist worker starts (or joins) the run's Prefect server at once, not waiting for it: it boots while the
    workers collect (the suite's tests nearly all run under xdist, and most of its files need it)."""
    if hasattr(config, "workerinput"):
        _start_shared_prefect(config, wait=False)


def pytest_collection_finish(session):
    """Start (or join) the run's Prefect server, and wait for it, if a test that will run needs it: never inside a
    test."""
    if any("prefect_harness" in getattr(item, "fixturenames", ()) for item in session.items):
        if "url" in _SHARED_PREFECT:
            _await_shared_prefect()
        else:
            _start_shared_prefect(session.config)


# Unique per run, removed at the end of the session.
OTHER_USER = f"rp-x{os.getpid()}"
# The system interpreter: root's pyenv under /root is not reachable by another user, by design.
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="session")
def other_user():
    """A second real local user, made with useradd, to act as the attacker."""
    import shutil
    import subprocess

    if os.getuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv") or not os.path.exists(
            SYSTEM_PYTHON):
        pytest.skip("needs root, useradd, setpriv and /usr/bin/python3 to act as another user")
    made = subprocess.run(["id", OTHER_USER], capture_output=True, check=False).returncode != 0
    if made:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER], check=True)
    yield OTHER_USER
    if made:
        subprocess.run(["userdel", OTHER_USER], capture_output=True, check=False)


@pytest.fixture
def engines(tmp_path, monkeypatch, request):
    """Stand-in container engines first on PATH; fails the test if a container is left running.

    Parametrized indirectly with False: path checks alone, as on a machine where no
    mount namespace can be made (they also catch a variable naming an unmounted path).
    """
    import json

    from engines import standin

    from resident_pool.host.procs import pid_alive

    state = tmp_path / "engine"
    isolate = getattr(request, "param", True)
    standin.install(tmp_path / "engine-bin", state, isolate=isolate)
    monkeypatch.setenv("PATH", f"{tmp_path / 'engine-bin'}:{os.environ['PATH']}")
    if isolate and not standin.can_isolate():
        print("stand-in engines check paths only: no mount namespace can be made here (not root)")
    yield state
    left = {}
    for entry in (state / "containers").glob("*") if (state / "containers").exists() else []:
        held = json.loads(entry.read_text() or "{}")
        if held.get("pid") and pid_alive(held["pid"]):
            left[entry.name] = held["pid"]
            os.kill(held["pid"], signal.SIGKILL)
    assert not left, f"containers left running: {left}"


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    if SECURITY_ROWS:
        write("")
        write("security: each attack tried, as another local user, a hostile input or payload, or a container")
        write(f"{'attack':<58} {'what the attacker got':<22} outcome")
        for row in SECURITY_ROWS:
            write(f"{row['attack']:<58} {row['got']:<22} {row['outcome']}")
    if not RELIABILITY_ROWS:
        return
    write("")
    write("reliability: every fault and input class tried (a leaked process fails its test)")
    write(f"{'fault or load':<46} {'lost':>5} {'leaked':>7}  what the caller saw / figures")
    for row in RELIABILITY_ROWS:
        extra = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("fault", "seen", "lost", "leaked"))
        write(f"{row['fault']:<46} {row['lost']:>5} {row['leaked']:>7}  {row['seen']}" + (f"; {extra}" if extra else ""))
