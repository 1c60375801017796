"""Code written for the original resident-worker design runs here unchanged.

Each test is named after one thing such code relies on. The workers, kits and callers
under tests/original/ were written from the original's three reference files alone;
the model side runs in a bare venv that holds none of this project.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from helpers import as_the_pool, state_dir, wait_listening, wait_until
from providers import make_kit_venv, write_provider

from resident_pool.host.procs import pid_alive
from resident_pool.protocol import connect, recv_line, send_line
from resident_pool.providers.worker_process import PROTOCOL_PATH, WORKER_BASE_PATH

ORIGINAL = Path(__file__).parent / "original"
WORKER = ORIGINAL / "worker.py"
KITS = ORIGINAL / "kits"
sys.path.insert(0, str(ORIGINAL))

import caller  # noqa: E402 - the original design's calling code, from tests/original


@pytest.fixture(scope="module")
def venvs(tmp_path_factory):
    """``venvs(*kits)``: the python of a bare venv (no pip, none of this project) holding those kits."""
    made: dict[tuple[str, ...], Path] = {}

    def make(*kits: str) -> Path:
        if kits not in made:
            folder = tmp_path_factory.mktemp("-".join(kits) or "bare")
            made[kits] = make_kit_venv(folder / "venv", *kits, kits_dir=KITS)
        return made[kits]

    return make


@pytest.fixture
def kit_home(tmp_path, monkeypatch):
    """The user's cache folder in the test's own folder; no MODEL_OPT variables from the caller."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for name in ("MODEL_OPT", "MODEL_OPT_JIT_ROOT", "MODEL_OPT_LEVERS_OFF"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def provider(root: Path, slug: str, python: Path, body: str = "") -> Path:
    """A provider running the original design's worker script in ``python``."""
    return write_provider(root, slug, f'[env]\npython = "{python}"\n{body}', worker=WORKER)


def report(pool, slug: str, **fields) -> dict:
    """The worker's own account of itself (environment, kits, names), through the pool."""
    return pool.predict(slug, {"sequence": "MKV", "report": True, **fields})["report"]


# -- the model side ------------------------------------------------------------------------


def test_a_worker_that_loads_the_base_from_TOOLUNIVERSE_REMOTE_WORKER_BASE_starts_under_the_pool(pool_dir, venvs):
    from resident_pool import Pool

    provider(pool_dir, "origin", venvs())
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("origin", {"sequence": "MKVLA", "report": True})
        pool.stop("origin")
    assert answer["length"] == 5 and answer["reversed"] == "ALVKM"
    seen = answer["report"]
    assert seen["env"]["TOOLUNIVERSE_REMOTE_WORKER_BASE"] == WORKER_BASE_PATH
    assert seen["env"]["TOOLUNIVERSE_REMOTE_PROTOCOL"] == PROTOCOL_PATH
    assert seen["ops"] == ["ping", "predict", "shutdown"]  # from protocol()
    assert seen["resident_pool_importable"] is False  # the bare venv: only the two files, by path


def test_a_worker_that_loads_the_base_from_TOOLUNIVERSE_REMOTE_WORKER_BASE_answers_the_cli(pool_dir, venvs, tmp_path):
    provider(pool_dir, "origin", venvs())
    payload = tmp_path / "payload.json"
    payload.write_text(json.dumps({"sequence": "GATTACA"}))
    done = subprocess.run([sys.executable, "-m", "resident_pool", "predict", "origin", "--input", str(payload)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["reversed"] == "ACATTAG"


def hand_run(python: Path, socket_path: str, *options: str, parent: bool = False, **env: str):
    """Start the worker as its author runs it by hand: the two paths set, and nothing of a pool (no heartbeat).

    Through a shell that exits at once, or with ``parent`` stays as the worker's parent (the test
    may kill it). Returns the shell's Popen and the worker's pid.
    """
    environ = {**os.environ, "TOOLUNIVERSE_REMOTE_WORKER_BASE": WORKER_BASE_PATH,
               "TOOLUNIVERSE_REMOTE_PROTOCOL": PROTOCOL_PATH, **env}
    command = f'"{python}" "{WORKER}" "{socket_path}" {" ".join(options)} >/dev/null & echo $!; '
    command += "wait" if parent else "exit 0"
    shell = subprocess.Popen(["sh", "-c", command], env=environ, stdout=subprocess.PIPE, text=True)
    with shell.stdout:
        pid = int(shell.stdout.readline())
    return shell, pid


def ask(socket_path: str, message: dict) -> dict | None:
    with connect(socket_path) as conn:
        send_line(conn, message)
        return recv_line(conn, bytearray())


def answers(socket_path: str) -> bool:
    try:
        return bool(ask(socket_path, {"op": "ping"})["ok"])
    except OSError:
        return False


@pytest.fixture
def socket_path():
    return str(state_dir() / "original.sock")


def test_worker_base_has_the_originals_public_names(venvs, socket_path):
    shell, _ = hand_run(venvs(), socket_path, parent=True)
    try:
        wait_until(lambda: answers(socket_path) or shell.poll() is not None, message="the worker to answer")
        seen = ask(socket_path, {"op": "ping"})
    finally:
        if answers(socket_path):
            ask(socket_path, {"op": "shutdown"})
        shell.wait(timeout=30)
    assert seen["names"] == {"PROTOCOL_ENV": "TOOLUNIVERSE_REMOTE_PROTOCOL",
                             "ORPHAN_GRACE_ENV": "TOOLUNIVERSE_RESIDENT_ORPHAN_GRACE_S",
                             "NO_CUBLAS_RELEASE_ENV": "TOOLUNIVERSE_RESIDENT_NO_CUBLAS_RELEASE",
                             "DEFAULT_ORPHAN_GRACE_S": 120.0}
    assert seen["bootstrap_serves"] is True and seen["ops"] == ["ping", "predict", "shutdown"]


def test_a_hand_run_worker_takes_its_orphan_grace_from_TOOLUNIVERSE_RESIDENT_ORPHAN_GRACE_S(venvs, socket_path):
    shell, pid = hand_run(venvs(), socket_path, parent=True, TOOLUNIVERSE_RESIDENT_ORPHAN_GRACE_S="1")
    try:
        wait_until(lambda: answers(socket_path), message="the worker to answer")
    finally:
        shell.kill()  # its parent dies: the worker is an orphan
        shell.wait()
    # One second of grace, not the default 120 s.
    wait_until(lambda: not pid_alive(pid), timeout=15, message="the orphaned worker to exit after its 1 s grace")


def test_a_hand_run_worker_turns_the_cublas_release_off_with_TOOLUNIVERSE_RESIDENT_NO_CUBLAS_RELEASE(venvs, socket_path):
    shell, pid = hand_run(venvs(), socket_path, parent=True, TOOLUNIVERSE_RESIDENT_NO_CUBLAS_RELEASE="1")
    try:
        wait_until(lambda: answers(socket_path), message="the worker to answer")
        for _ in range(2):
            assert ask(socket_path, {"op": "predict", "payload": {"sequence": "MKV"}})["ok"]
        assert ask(socket_path, {"op": "ping"})["releases"] == 0
    finally:
        ask(socket_path, {"op": "shutdown"})
        shell.wait(timeout=30)
    wait_until(lambda: not pid_alive(pid), message="the worker to exit")


def test_a_hand_run_worker_whose_parent_died_before_the_base_was_imported_exits_once_idle(venvs, socket_path):
    """A two-second grace (the project's variable, so only the parent rule is tried here)."""
    shell, pid = hand_run(venvs(), socket_path, "--await-orphan", RESIDENT_POOL_ORPHAN_GRACE_S="2")
    shell.wait(timeout=10)
    wait_until(lambda: answers(socket_path), message="the orphaned worker to serve")
    wait_until(lambda: not pid_alive(pid), timeout=15, message="the worker orphaned early to notice and exit")


def test_a_worker_with_a_heartbeat_is_not_judged_by_its_parent_pid_of_1(venvs, socket_path, tmp_path):
    """A container worker's parent is pid 1 under --init: only its heartbeat says whether its pool lives.
    Shortened: a one-second grace and a two-second heartbeat."""
    heartbeat = tmp_path / "heartbeat"
    heartbeat.touch()
    beating = threading.Event()
    beating.set()

    def beat():
        while beating.is_set():
            os.utime(heartbeat)
            time.sleep(0.2)

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    shell, pid = hand_run(venvs(), socket_path, "--await-orphan", RESIDENT_POOL_ORPHAN_GRACE_S="1",
                          RESIDENT_POOL_HEARTBEAT=str(heartbeat), RESIDENT_POOL_HEARTBEAT_STALE_S="2")
    shell.wait(timeout=10)
    try:
        wait_until(lambda: answers(socket_path), message="the worker to answer")
        # Idle for three times its grace with a parent pid of 1, and still serving: its heartbeat is fresh.
        wait_until(lambda: ask(socket_path, {"op": "ping"})["uptime_s"] >= 3, message="three seconds of uptime")
        assert pid_alive(pid) and ask(socket_path, {"op": "predict", "payload": {"sequence": "MKV"}})["ok"]
    finally:
        beating.clear()
    wait_until(lambda: not pid_alive(pid), timeout=15, message="the worker to exit once its heartbeat is stale")


def test_a_predict_without_payload_hands_the_whole_request_to_on_predict(venvs, socket_path):
    shell, _ = hand_run(venvs(), socket_path, parent=True)
    try:
        wait_until(lambda: answers(socket_path), message="the worker to answer")
        reply = ask(socket_path, {"op": "predict", "sequence": "MKVLA"})
        carried = ask(socket_path, {"op": "predict", "payload": {"sequence": "GG"}})
    finally:
        ask(socket_path, {"op": "shutdown"})
        shell.wait(timeout=30)
    assert reply["ok"], reply
    assert reply["result"]["length"] == 5 and reply["result"]["keys"] == ["op", "sequence"]
    assert carried["result"]["keys"] == ["sequence"]  # this project's own shape still means its payload


def test_a_worker_that_loads_the_base_under_a_dotted_name_starts_under_the_pool(pool_dir, venvs):
    """The original's worker_base finds its protocol by path whatever name it was loaded under. Loaded as
    `tooluniverse.remote_resident.worker_base` (its name in the original's package), `protocol()` took the
    dotted name for "imported as part of resident_pool" and raised ModuleNotFoundError: exit 1 before bind."""
    from resident_pool import Pool

    write_provider(pool_dir, "dotted", f'[env]\npython = "{venvs()}"\n', worker=ORIGINAL / "dotted_worker.py")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("dotted", {"sequence": "MKVLA"})
        pool.stop("dotted")
    assert answer == {"reversed": "ALVKM", "ping_op": "ping", "arrays": True}


def test_a_worker_with_its_own_accept_loop_over_protocol_serves_a_second_client(venvs, socket_path):
    """The original's recv_line raises ProtocolError at the end of a stream, and a loop written to it leaves a
    connection only that way. This project's returns None there: the loop's `req.get("op")` raised
    AttributeError and the worker died when its first client hung up."""
    env = {**os.environ, "TOOLUNIVERSE_REMOTE_WORKER_BASE": WORKER_BASE_PATH,
           "TOOLUNIVERSE_REMOTE_PROTOCOL": PROTOCOL_PATH}
    worker = subprocess.Popen([str(venvs()), str(ORIGINAL / "raw_loop_worker.py"), socket_path], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(socket_path, worker)  # its own loop binds, then listens: the file comes first
        # One client after another, each hanging up after its answer.
        replies = [ask(socket_path, {"op": "ping"}) for _ in range(3)]
        alive = worker.poll() is None
        if alive:
            assert ask(socket_path, {"op": "shutdown"}) == {"ok": True, "op": "shutdown"}
            worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
        said = worker.communicate(timeout=30)[0]
    assert alive and replies == [{"ok": True, "op": "ping"}] * 3, said[-1500:]
    assert worker.returncode == 0, said[-1500:]


def test_protocol_recv_line_raises_at_the_end_of_a_stream_and_load_protocol_s_returns_none():
    """The original's shape for code written to it; this project's own (load_protocol, resident_pool.protocol)
    is unchanged."""
    import socket as sockets

    from resident_pool import protocol as wire
    from resident_pool import worker_base

    original = worker_base.protocol()
    assert original.OP_PREDICT == "predict" and original.ProtocolError is wire.ProtocolError
    assert worker_base.load_protocol() is wire and original.__file__ == wire.__file__
    for receive, at_end in ((original.recv_line, "raises"), (worker_base.load_protocol().recv_line, None)):
        left, right = sockets.socketpair()
        with left, right:
            original.send_line(left, {"a": 1})
            left.close()
            buf = bytearray()
            assert receive(right, buf) == {"a": 1}
            if at_end is None:
                assert receive(right, buf) is None
            else:
                with pytest.raises(wire.ProtocolError, match="peer closed the connection mid-message"):
                    receive(right, buf)


# -- the caller: ResidentWorker --------------------------------------------------------------


def test_the_originals_caller_names_import_from_resident_pool_supervisor():
    from resident_pool.supervisor import (  # noqa: F401 - importing them is the test
        EXIT_HINTS,
        CommandBuilder,
        ResidentWorker,
        WorkerRequestError,
        WorkerStartError,
        child_env,
        exit_hint,
    )

    assert child_env({"GONE": None, "SET": "1"}, {"GONE": "x", "KEPT": "y"}) == {"SET": "1", "KEPT": "y"}
    assert {3, 5} <= set(EXIT_HINTS)


def test_a_caller_queues_on_the_public_lock(venvs):
    worker = caller.worker_for(str(WORKER), python=str(venvs()))
    try:
        results, errors = caller.fold_all(worker, ["MKV", "GATTACA", "AAAA", "W"])
        assert errors == []
        assert {sequence: result["length"] for sequence, result in results.items()} == \
            {"MKV": 3, "GATTACA": 7, "AAAA": 4, "W": 1}
        # Held across two requests: a third caller waits until it is let go.
        asking, finished = threading.Event(), []

        def third():
            asking.set()
            finished.append(worker.request({"op": "predict", "sequence": "X"})["result"]["length"])

        with worker.lock:
            other = threading.Thread(target=third)
            other.start()
            assert asking.wait(timeout=10)
            first = worker.request({"op": "predict", "sequence": "AB"})["result"]["pid"]
            second = worker.request({"op": "predict", "sequence": "ABC"})["result"]["pid"]
            assert finished == []  # still queued behind the holder
        other.join(timeout=30)
        assert first == second and finished == [1]
    finally:
        worker.stop()


def test_request_sends_the_message_as_given_and_returns_the_whole_reply(venvs):
    worker = caller.worker_for(str(WORKER), python=str(venvs()))
    try:
        reply = worker.request({"op": "predict", "sequence": "MKVLA"})
        pong = worker.request({"op": "ping"})
        result = worker.predict({"sequence": "MKVLA"})
    finally:
        worker.stop()
    assert reply["ok"] is True and reply["result"]["length"] == 5
    assert reply["result"]["keys"] == ["op", "sequence"]  # the message as given: no payload wrapped around it
    assert pong["ok"] and pong["model"] == "original" and "releases" in pong
    assert result["length"] == 5 and result["keys"] == ["sequence"]  # predict(payload): the result alone


def test_a_build_command_whose_argv_holds_paths_starts_its_worker(venvs):
    """The original hands build_command's argv to Popen as it is, and Popen takes path objects. Here the worker
    was spawned, then its argv joined for the transcript's note raised a bare TypeError: the worker was killed
    and the caller got neither a reply nor a WorkerStartError."""
    from resident_pool.supervisor import ResidentWorker

    def build(worker):
        return [venvs(), WORKER, worker.socket_path], {"ORIGINAL_CALLER": "1"}

    worker = ResidentWorker("origin", build)
    try:
        with worker.lock:
            reply = worker.request({"op": "predict", "sequence": "MKV"})
    finally:
        worker.stop()
    assert reply["ok"] and reply["result"]["reversed"] == "VKM"
    unusable = ResidentWorker("origin", lambda worker: ([str(venvs()), str(WORKER), 3], {}))
    try:
        with pytest.raises(TypeError, match=r"the worker's argv\[2\] is 3 \(int\): give a str, bytes or path"):
            unusable.ensure_started()
    finally:
        unusable.stop()


def test_start_and_request_errors_are_runtime_errors(venvs, tmp_path):
    from resident_pool import WorkerRequestError, WorkerStartError

    refusing = tmp_path / "refuses.py"
    refusing.write_text("import sys\nsys.stderr.write('REFUSED: no such device\\n')\nsys.exit(3)\n")
    worker = caller.worker_for(str(refusing), python=str(venvs()))
    try:
        with pytest.raises(RuntimeError) as started:
            worker.ensure_started()
    finally:
        worker.stop()
    assert isinstance(started.value, WorkerStartError) and started.value.exit_code == 3
    worker = caller.worker_for(str(WORKER), python=str(venvs()))
    try:
        with pytest.raises(RuntimeError) as asked:
            worker.request({"op": "predict", "sequence": "MKV", "fail": True})
    finally:
        worker.stop()
    assert isinstance(asked.value, WorkerRequestError) and asked.value.reason == "request_failed"
    assert "cannot fold 'MKV'" in str(asked.value)


def test_worker_request_error_takes_its_reason_by_position():
    from resident_pool.supervisor import WorkerRequestError

    error = WorkerRequestError("origin: the worker died", "worker_died")
    assert error.reason == "worker_died" and str(error) == "origin: the worker died"
    assert WorkerRequestError("origin: failed").reason == "request_failed"


def test_exit_hint_is_a_dash_clause_or_nothing():
    from resident_pool.supervisor import EXIT_HINTS, exit_hint

    assert exit_hint(3) == f" \u2014 {EXIT_HINTS[3]}"
    assert exit_hint(5).startswith(" \u2014 ") and "KERNELS" in exit_hint(5)
    assert exit_hint(42) == "" and exit_hint(None) == ""
    message = f"origin: the resident worker exited 3 before it bound its socket{exit_hint(3)}"
    assert message.endswith(EXIT_HINTS[3])


def ledger() -> list[dict]:
    """The pool's ledger file: what every worker of this user holds on the host."""
    return json.loads((state_dir() / "ledger.json").read_text())


def fake_device(tmp_path: Path, monkeypatch, total_gb: float) -> None:
    """One device of ``total_gb``, all of it free, whatever this host has (a fake NVML reading)."""
    readings = tmp_path / "nvml.json"
    readings.write_text(json.dumps({"devices": [{"total_gb": total_gb, "free_gb": total_gb}]}))
    monkeypatch.setenv("RESIDENT_POOL_FAKE_NVML", str(readings))
    monkeypatch.setenv("RESIDENT_POOL_GPU_HEADROOM_GB", "0")


def test_admit_with_a_budget_and_no_admitter_refuses_a_budget_no_device_can_hold(venvs, tmp_path, monkeypatch):
    fake_device(tmp_path, monkeypatch, 1)
    worker = caller.worker_for(str(WORKER), python=str(venvs()), vram_budget_gb=1000)
    try:
        with pytest.raises(Exception, match="needs 1000 GB") as info:
            worker.ensure_started()
    finally:
        worker.stop()
    assert type(info.value).__name__ == "AdmissionRefused"
    assert worker.pid is None  # nothing was started


def test_admit_with_a_budget_and_no_admitter_waits_in_the_pools_ledger(venvs, tmp_path, monkeypatch):
    fake_device(tmp_path, monkeypatch, 2)
    first = caller.worker_for(str(WORKER), python=str(venvs()), vram_budget_gb=1.5)
    second = caller.worker_for(str(WORKER), python=str(venvs()), vram_budget_gb=1.5, replica=1)
    outcome = []
    try:
        first.ensure_started()
        held = ledger()
        assert [(e["slug"], e["replica"], e["budget_gb"], e["pid"]) for e in held] == [("origin", 0, 1.5, first.pid)]
        waiting = threading.Thread(target=lambda: outcome.append(second.request({"op": "predict", "sequence": "A"})))
        waiting.start()
        wait_until(lambda: second.state == "starting", message="the second worker to ask for its budget")
        assert second.pid is None  # waiting for the device, not started beside the first
        first.stop()
        waiting.join(timeout=60)
        assert outcome and outcome[0]["ok"]
        held = ledger()
        assert [(e["slug"], e["replica"], e["pid"]) for e in held] == [("origin", 1, second.pid)]
    finally:
        first.stop()
        second.stop()
    assert ledger() == []


# -- the kit launcher ------------------------------------------------------------------------


def test_a_kit_whose_stack_cannot_import_is_probed_without_it(pool_dir, venvs, kit_home):
    """Autoload, its mode variable on _autoload, no modes module, a stack.py needing a compiled extension."""
    from resident_pool import Pool

    provider(pool_dir, "stackless", venvs("stackless_opt"),
             '[kit]\npackage = "stackless_opt"\nmode = "fast"\nenv_row = "none"\n'
             'env_row_reason = "no modes module: the kit keeps no row"\n')
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, "stackless")
        pool.stop("stackless")
    assert seen["kits"] == {"stackless_opt": "ACTIVE"} and seen["env"]["STACKLESS_OPT"] == "fast"


def test_resolve_is_asked_with_the_mode_alone_before_the_kit_tree(pool_dir, venvs, kit_home):
    from resident_pool import Pool

    provider(pool_dir, "resolving", venvs("resolving_opt"), '[kit]\npackage = "resolving_opt"\nmode = "fast"\n')
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, "resolving")
        pool.stop("resolving")
    assert seen["env"]["RESOLVING_PROFILE"] == "default"  # not the kit tree in the profile parameter
    assert seen["env"]["RESOLVING_FUSED"] == "1" and seen["kits"] == {"resolving_opt": "ACTIVE"}


def test_a_kit_whose_resolve_answers_a_read_only_mapping_serves_with_its_row(pool_dir, venvs, kit_home):
    """The original's probe reads env as an attribute, else by key: any mapping answers. Here only a dict was
    read by key, so a kit whose resolve() hands out a MappingProxyType exported an empty row and was refused."""
    from resident_pool import Pool
    from resident_pool.kit import ask_kit

    python = venvs("proxied_opt")
    assert ask_kit(python, "proxied_opt", "fast")["env"] == {"PROXIED_OPT_ROUTE": "triton"}
    provider(pool_dir, "proxied", python, '[kit]\npackage = "proxied_opt"\n')
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, "proxied")
        pool.stop("proxied")
    assert seen["env"]["PROXIED_OPT_ROUTE"] == "triton" and seen["env"]["MODEL_OPT"]


class _Exports:
    exports = types.MappingProxyType({"B": 2})


@pytest.mark.parametrize("answer", [
    {"env": {"A": 1}},
    types.MappingProxyType({"env": types.MappingProxyType({"A": 1})}),
    collections.UserDict({"exports": collections.UserDict({"A": 1})}),
    types.SimpleNamespace(env={"A": 1}),
], ids=["dict", "mappingproxy", "UserDict", "object"])
def test_a_resolve_answer_is_read_by_attribute_or_by_key_as_the_original(answer):
    from resident_pool import kit_probe

    assert kit_probe._vars(answer) == {"A": "1"}
    assert kit_probe._vars(_Exports()) == {"B": "2"}
    assert kit_probe._vars(["env"]) is None and kit_probe._vars({"other": {}}) is None


def test_the_originals_kit_env_takes_a_number_as_its_text(tmp_path):
    """The original launcher applies `[kit] env` with str(value): `POST_RELEASE_NTOK = 0` is "0". Here
    `Kit.env` was dict[str, str] under a strict model, so a manifest the original ran was a ManifestError."""
    from resident_pool.errors import ManifestError
    from resident_pool.manifest import load_manifest

    folder = tmp_path / "manifests" / "numbered"
    folder.mkdir(parents=True)
    shutil.copy(WORKER, folder / "worker.py")
    table = '[kit]\npackage = "proxied_opt"\n[kit.env]\n'
    (folder / "manifest.toml").write_text(f'slug = "numbered"\nworker = "worker.py"\n{table}'
                                          "PROXIED_OPT_POST_RELEASE_NTOK = 0\nPROXIED_OPT_CAP = 1.5\n"
                                          "PROXIED_OPT_ON = true\nPROXIED_OPT_NAME = \"x\"\n")
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.kit.env == {"PROXIED_OPT_POST_RELEASE_NTOK": "0", "PROXIED_OPT_CAP": "1.5",
                                "PROXIED_OPT_ON": "True", "PROXIED_OPT_NAME": "x"}
    (folder / "manifest.toml").write_text(f'slug = "numbered"\nworker = "worker.py"\n{table}'
                                          "PROXIED_OPT_LIST = [1, 2]\n")
    with pytest.raises(ManifestError, match=r"kit\.env\.PROXIED_OPT_LIST"):
        load_manifest(folder / "manifest.toml")


@pytest.mark.parametrize(("slug", "table", "package"), [
    ("subdir", 'subdir = "resolving"\n', "resolving_opt"),
    ("resolving", "", "resolving_opt"),  # no package, name or subdir: <slug>_opt
    ("probed", 'package = "resolving_opt"\nenv_row = "probe"\n', "resolving_opt"),
])
def test_the_originals_kit_keys_and_defaults_are_accepted(pool_dir, venvs, kit_home, slug, table, package):
    from resident_pool import Pool
    from resident_pool.manifest import load_manifest

    path = provider(pool_dir, slug, venvs("resolving_opt"), f"[kit]\n{table}")
    manifest = load_manifest(path)
    assert (manifest.kit.package_name, manifest.kit.mode, manifest.kit.env_row) == (package, "fast", "probe")
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, slug)
        pool.stop(slug)
    assert seen["env"]["RESOLVING_OPT"] == "fast" and seen["kits"] == {"resolving_opt": "ACTIVE"}


def test_MODEL_OPT_LEVERS_OFF_is_exported_only_when_a_lever_is_off(pool_dir, venvs, kit_home):
    from resident_pool import Pool

    python = venvs("resolving_opt")
    provider(pool_dir, "whole", python, '[kit]\npackage = "resolving_opt"\nmode = "fast"\n')
    provider(pool_dir, "ablated", python, '[kit]\npackage = "resolving_opt"\nmode = "fast"\nlevers_off = ["fusion"]\n')
    with Pool(manifests=pool_dir) as pool:
        whole, ablated = report(pool, "whole"), report(pool, "ablated")
        pool.stop(None)
    assert "MODEL_OPT_LEVERS_OFF" not in whole["env"] and whole["kits"] == {"resolving_opt": "ACTIVE"}
    assert ablated["env"]["MODEL_OPT_LEVERS_OFF"] == "fusion" and ablated["kits"] == {"resolving_opt": "PARTIAL"}


def test_the_kit_probe_is_given_KIT_PROBE_TIMEOUT_S_of_180_s_here_shortened_to_half_a_second(
        tmp_path, kit_home, monkeypatch):
    from resident_pool.kit import KIT_PROBE_TIMEOUT_S

    assert KIT_PROBE_TIMEOUT_S == 180.0
    from resident_pool import KitUnavailable
    from resident_pool.manifest import load_manifest
    from resident_pool.providers import kit_rules
    from resident_pool.providers.launch import LaunchPlan

    kits = tmp_path / "kits"
    (kits / "hanging_opt").mkdir(parents=True)
    (kits / "hanging_opt" / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    python = make_kit_venv(tmp_path / "venv", "hanging_opt", kits_dir=kits)
    manifest = load_manifest(provider(tmp_path / "manifests", "hanging", python, '[kit]\npackage = "hanging_opt"\n'))
    monkeypatch.setattr(kit_rules, "KIT_PROBE_TIMEOUT_S", 0.5)
    with pytest.raises(KitUnavailable, match=r"timed out after 0\.5 seconds"):
        LaunchPlan.resolve(manifest, "/tmp/unused.sock", **as_the_pool()).probe()


def test_the_jit_cache_default_is_under_the_pools_cache_folder(pool_dir, venvs, kit_home, monkeypatch):
    from resident_pool import Pool

    monkeypatch.setenv("RESIDENT_POOL_CACHE_DIR", str(kit_home / "pool-cache"))
    provider(pool_dir, "cached", venvs("resolving_opt"), '[kit]\npackage = "resolving_opt"\nmode = "fast"\n')
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, "cached")
        pool.stop("cached")
    assert seen["env"]["MODEL_OPT_JIT_ROOT"] == str(kit_home / "pool-cache" / "jit" / "cached" / "resolving-2.1-cpu")


def test_kit_unavailable_is_a_runtime_error(tmp_path, venvs, kit_home):
    from resident_pool import KitUnavailable
    from resident_pool.manifest import load_manifest
    from resident_pool.providers.launch import LaunchPlan

    manifest = load_manifest(provider(tmp_path / "manifests", "absent", venvs(),
                                      '[kit]\npackage = "absent_opt"\nmode = "fast"\n'))
    with pytest.raises(RuntimeError) as info:
        LaunchPlan.resolve(manifest, "/tmp/unused.sock", **as_the_pool()).probe()
    assert isinstance(info.value, KitUnavailable) and "absent_opt gave no KITROW line" in str(info.value)


def test_the_launchers_public_helpers_keep_the_originals_meaning(tmp_path, venvs, kit_home, monkeypatch):
    from resident_pool import kit
    from resident_pool.manifest import load_manifest
    from resident_pool.supervisor import ResidentWorker

    python = venvs("resolving_opt")
    root = tmp_path / "manifests"
    named = load_manifest(provider(root, "named", python, '[kit]\npackage = "resolving_opt"\nmode = "fast"\n'))
    assert kit.kit_package(named) == "resolving_opt"
    assert kit.kit_package(load_manifest(provider(root, "folded", python, '[kit]\nsubdir = "boltz2"\n'))) == "boltz2_opt"
    assert kit.kit_package(load_manifest(provider(root, "chai1", python, "[kit]\n"))) == "chai1_opt"

    monkeypatch.setenv("RESOLVING_OPT_STRAY", "1")  # the kit would exit 3 beside it: the probe runs without it
    row = kit.ask_kit(str(python), "resolving_opt", "fast", ["fusion"])
    assert row["env"] == {"RESOLVING_PROFILE": "default", "RESOLVING_FUSED": "1"}
    assert row["row_source"] == "resolve(mode)" and row["stack_key"] == "resolving-2.1-cpu"
    assert row["activation"] == "autoload" and row["opts"] == [] and row["mode_env"] == "RESOLVING_OPT"
    assert row["model_opt"] == str(python.parents[1] / "resolving_opt-checkout")

    worker = ResidentWorker("named", kit.build_command, manifest=named)
    try:
        argv, env = kit.build_command(worker)
        assert argv[-2:] == [str(named.worker_path), worker.socket_path] and env["RESOLVING_OPT"] == "fast"
        assert env["RESOLVING_OPT_STRAY"] is None  # removed from the worker's environment, not only the probe's
        seen = worker.request({"op": "predict", "sequence": "MKV", "report": True})["result"]["report"]
    finally:
        worker.stop()
    assert seen["kits"] == {"resolving_opt": "ACTIVE"} and "RESOLVING_OPT_STRAY" not in seen["env"]


def test_a_worker_launch_kit_runs_the_originals_worker_under_the_pool(pool_dir, venvs, kit_home):
    from resident_pool import Pool

    provider(pool_dir, "launched", venvs("launching_opt"), '[kit]\npackage = "launching_opt"\nmode = "triton"\n')
    with Pool(manifests=pool_dir) as pool:
        seen = report(pool, "launched")
        pool.stop("launched")
    assert seen["env"]["LAUNCHING_ROUTE"] == "triton" and seen["env"]["LAUNCHING_KERNELS"] == "triton"
    assert "LAUNCHING_OPT" not in seen["env"]  # the launcher arms the kit; its mode variable would arm it twice
    assert seen["argv"][0].endswith("worker.py")


@pytest.mark.usefixtures("prefect_harness")
def test_the_originals_worker_under_a_worker_launch_kit_answers_a_prefect_task(pool_dir, venvs, kit_home):
    from prefect import flow, task

    from resident_pool.prefect import predict

    provider(pool_dir, "launched", venvs("launching_opt"), '[kit]\npackage = "launching_opt"\nmode = "triton"\n')
    provider(pool_dir, "origin", venvs())

    @task
    def fold(slug, sequence):
        return predict(slug, {"sequence": sequence, "report": True})

    @flow
    def screen():
        return [fold(slug, "MKVLA") for slug in ("origin", "launched")]

    plain, launched = screen()
    assert plain["reversed"] == launched["reversed"] == "ALVKM"
    assert launched["report"]["env"]["LAUNCHING_ROUTE"] == "triton"
    assert plain["report"]["env"]["TOOLUNIVERSE_REMOTE_WORKER_BASE"] == WORKER_BASE_PATH

