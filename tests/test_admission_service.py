"""The host-wide admission service as a real process: its socket, real pools of real users, quotas, hostile clients.

The service runs as `resident-pool admission-service` with a declared 10 GB card. Tests that
need a second real user (root only) run that user's pool with the system interpreter and this
checkout on PYTHONPATH (root's own interpreter lives under /root, which no other user may read).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import select
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import SYSTEM_PYTHON
from helpers import TAG_VARIABLE, wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.errors import ResidentPoolError
from resident_pool.host.procs import pid_alive
from resident_pool.protocol import recv_line, send_line

ROOT = Path(__file__).resolve().parents[1]
SITE = sysconfig.get_paths()["purelib"]
GPU = '[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n[lifecycle]\nadmission_timeout_s = 60\n'


def _group_for_the_service() -> str:
    """A group of its own where root can make one (users are added to it), else this user's primary group."""
    if os.getuid() != 0:
        return grp.getgrgid(os.getgid()).gr_name
    name = f"rp-g{os.getpid()}"
    if subprocess.run(["getent", "group", name], capture_output=True, check=False).returncode != 0:
        subprocess.run(["groupadd", name], check=True)
    return name


@pytest.fixture(scope="module")
def service_group():
    name = _group_for_the_service()
    yield name
    if os.getuid() == 0 and name.startswith("rp-g"):
        subprocess.run(["groupdel", name], capture_output=True, check=False)


class Service:
    def __init__(self, folder: Path, group: str) -> None:
        self.folder = folder
        self.group = group
        self.socket = str(folder / "run" / "admission.sock")
        self.audit = folder / "audit.jsonl"
        self.config = folder / "etc" / "admission.toml"
        self.proc: subprocess.Popen | None = None

    def start(self, extra: str = "") -> Service:
        self.config.parent.mkdir(exist_ok=True)
        self.config.write_text(textwrap.dedent(f"""\
            socket = "{self.socket}"
            group = "{self.group}"
            state_dir = "{self.folder / 'state'}"
            audit = "{self.audit}"
            capacity_gb = "10"
            headroom_gb = 0
            """) + textwrap.dedent(extra))
        self.proc = subprocess.Popen([sys.executable, "-m", "resident_pool", "admission-service", "--config",
                                      str(self.config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wait_until(lambda: os.path.exists(self.socket) or self.proc.poll() is not None, timeout=30,
                   message="the admission service's socket")
        assert self.proc.poll() is None, self.proc.stdout.read()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            self.proc.communicate(timeout=10)

    def ask(self, *messages: dict) -> list[dict]:
        """Raw requests on one connection, as root: the replies."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(self.socket)
            buf, replies = bytearray(), []
            for number, message in enumerate(messages):
                send_line(sock, {"id": number, **message})
                reply = recv_line(sock, buf, 1 << 20)
                while reply is not None and "push" in reply:
                    reply = recv_line(sock, buf, 1 << 20)
                replies.append(reply)
            return replies

    def states(self) -> list[list[dict]]:
        return [json.loads(line)["entries"] for line in self.audit.read_text().splitlines()] if \
            self.audit.exists() else []


@pytest.fixture
def service(service_group, monkeypatch):
    folder = Path(tempfile.mkdtemp(prefix="rp-svc-"))
    folder.chmod(0o755)  # other users reach the socket's folder; the socket itself is 0660
    (folder / "run").mkdir(mode=0o755)
    made = Service(folder, service_group)
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", made.socket)
    yield made
    made.stop()
    shutil.rmtree(folder, ignore_errors=True)


# -- the service itself ------------------------------------------------------------------------------------------
def test_its_socket_is_0660_in_its_group_and_a_config_others_can_write_is_refused(service, tmp_path):
    service.start()
    info = os.stat(service.socket)
    assert oct(info.st_mode & 0o777) == "0o660" and grp.getgrgid(info.st_gid).gr_name == service.group
    service.stop()
    service.config.chmod(0o666)
    done = subprocess.run([sys.executable, "-m", "resident_pool", "admission-service", "--config",
                           str(service.config)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and str(service.config) in done.stderr and "chmod go-w" in done.stderr


def test_the_admission_socket_is_already_0660_in_its_group_when_it_appears(tmp_path, monkeypatch):
    """Review of the rename: the socket appeared at its path 0600 in the owner's group and was only then chown'd
    and made 0660, so a pool of a group member that found it in between got EACCES ("does not answer")."""
    from resident_pool.admission import service as svc
    from resident_pool.admission.config import ServiceConfig

    group = next(g for g in grp.getgrall() if g.gr_gid != os.getgid())  # not the owner's: a chown must happen
    (tmp_path / "run").mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    config = ServiceConfig(socket=str(tmp_path / "run" / "a.sock"), group=group.gr_name,
                           state_dir=str(tmp_path / "state"), audit=str(tmp_path / "audit.jsonl"), capacity_gb="10",
                           headroom_gb=0)
    first_seen = []
    real = svc.bind_unix

    def watched(*args, **kwargs):
        listener = real(*args, **kwargs)
        info = os.stat(config.socket)  # the moment it is at its path, a client may find it
        first_seen.append((oct(info.st_mode & 0o777), info.st_gid))
        return listener

    monkeypatch.setattr(svc, "bind_unix", watched)
    service = svc.AdmissionService(config)
    service.bind()
    try:
        assert first_seen == [("0o660", group.gr_gid)]
    finally:
        service.close()


def test_a_pool_uses_the_service_and_status_says_so_with_the_queue_in_order_and_its_classes(
        service, pool_dir, monkeypatch):
    service.start()
    write_provider(pool_dir, "a6", GPU.format(budget=6))
    write_provider(pool_dir, "b6", GPU.format(budget=6))
    with Pool() as pool, pool.session("a6", priority="interactive") as held:
        held.predict({"action": "echo"})
        waiting = subprocess.Popen([sys.executable, "-c", "from resident_pool import Pool; "
                                    "Pool().predict('b6', {'action': 'echo'}, priority='batch')"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            row = wait_until(lambda: [w for w in pool.waiting() if w.get("needs_gb")], timeout=30,
                             message="b6 waiting for memory")[0]
            assert (row["slug"], row["priority"], row["needs_gb"]) == ("b6", "batch", 6)
            assert "a6[0] 6 GB on GPU 0, leased" in "; ".join(row["held"]) and "interactive" in "; ".join(row["held"])
            state = pool.status()
            assert state["admission"]["mode"] == "host admission service"
            assert state["admission"]["socket"] == service.socket
            assert [(e["slug"], e["user"]) for e in state["ledger"]] == [("a6", pwd.getpwuid(os.getuid()).pw_name)]
            shown = subprocess.run([sys.executable, "-m", "resident_pool", "status"], capture_output=True,
                                   text=True, timeout=60, check=True, env={**os.environ, "COLUMNS": "250"}).stdout
            assert "the host admission service" in shown and "batch" in shown and "b6" in shown
        finally:
            held.release()
        waiting.communicate(timeout=60)
        assert waiting.returncode == 0
    assert all(sum(e["budget_gb"] for e in state) <= 10 for state in service.states())


def test_without_the_service_status_says_the_per_user_ledger_is_in_force(pool_dir, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", "off")
    write_provider(pool_dir, "echo1", "")
    with Pool() as pool:
        pool.predict("echo1", {"action": "echo"})
        admission = pool.status()["admission"]
    assert admission["mode"] == "per-user ledger" and admission["ledger"].endswith("ledger.json")


def test_a_pool_told_to_use_a_service_that_does_not_answer_fails_loudly_instead_of_oversubscribing(
        pool_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", str(tmp_path / "nobody.sock"))
    write_provider(pool_dir, "a6", GPU.format(budget=6))
    done = subprocess.run([sys.executable, "-m", "resident_pool", "daemon", "--manifests", str(pool_dir)],
                          capture_output=True, text=True, timeout=60, check=False)
    said = " ".join(done.stderr.split())
    assert done.returncode == 2 and "does not answer" in said and "ADMISSION_SERVICE=off" in said
    started = time.monotonic()
    with Pool() as pool, pytest.raises(ResidentPoolError, match="does not answer") as info:
        pool.predict("a6", {})  # the client that starts a pool hears why at once, not after its 60 s wait
    assert info.value.reason == "pool_start_failed" and time.monotonic() - started < 30


def test_with_auto_a_service_whose_configuration_exists_is_in_force_while_its_socket_is_missing_in_a_restart(
        pool_dir, monkeypatch, tmp_path):
    """Review r25: `auto` took the service as in force only while its socket existed, so a pool started during a
    service restart silently used its own ledger for its whole life, beside every other user's pool on the one
    ledger. The service's configuration file survives a restart: where it exists, the service is in force (at the
    socket it names), and a missing socket is the loud "does not answer"."""
    from resident_pool.admission.remote import connect_service, probe_service, service_socket
    from resident_pool.settings import settings

    socket_path = tmp_path / "run" / "admission.sock"  # the service is restarting: no socket yet
    config = tmp_path / "admission.toml"
    config.write_text(f'socket = "{socket_path}"\n')
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", "auto")  # the default, said
    monkeypatch.setenv("RESIDENT_POOL_ADMISSION_CONFIG", str(config))
    assert service_socket(settings()) == str(socket_path)
    with pytest.raises(ResidentPoolError, match="does not answer") as info:
        connect_service(settings(), lambda: None, lambda *a: None)
    assert info.value.reason == "admission_service_down"
    with pytest.raises(ResidentPoolError, match="does not answer"):
        probe_service(settings())
    write_provider(pool_dir, "a6", GPU.format(budget=6))
    done = subprocess.run([sys.executable, "-m", "resident_pool", "daemon", "--manifests", str(pool_dir)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "does not answer" in " ".join(done.stderr.split())
    config.unlink()  # no service on this host: the per-user ledger, as before
    assert service_socket(settings()) is None


def test_a_pool_killed_mid_admission_has_its_budget_reclaimed_once_its_worker_is_gone(
        service, pool_dir, isolated_dirs):
    service.start()
    write_provider(pool_dir, "big", 'worker_args = ["{socket}", "--load-seconds", "30"]\n' + GPU.format(budget=6))
    client = subprocess.Popen([sys.executable, "-c", "from resident_pool import Pool; Pool().predict('big', {})"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    entry = None
    try:
        entry = wait_until(lambda: [e for s in service.states()[-1:] for e in s if e["pid"] != _pool_pid(
            isolated_dirs)], timeout=30, message="the loading worker to hold the entry")[0]
        os.kill(_pool_pid(isolated_dirs), signal.SIGKILL)  # the entry names the worker now: it outlives the pool
        assert [e["slug"] for e in service.ask({"op": "status"})[0]["entries"]] == ["big"]
        os.kill(entry["pid"], signal.SIGKILL)  # the orphan grace, made short
        wait_until(lambda: service.ask({"op": "status"})[0]["entries"] == [], timeout=10,
                   message="the dead pool's budget to be reclaimed")
    finally:
        client.kill()
        client.wait()
        if entry is not None and pid_alive(entry["pid"]):
            os.kill(entry["pid"], signal.SIGKILL)


def _pool_pid(isolated_dirs) -> int:
    return int(Path(isolated_dirs["state"], "pool.pid").read_text())


def test_a_hostile_client_gets_errors_and_the_service_keeps_serving_pools(service, pool_dir):
    service.start("max_asks_per_pool = 4\n")
    replies = service.ask({"op": "nope"}, {"op": "place", "key": "../../etc[0]"},
                          {"op": "place", "key": "a[0]", "slug": "a", "replica": 0, "need_gb": "1e309"},
                          {"op": "place", "key": "a[0]", "slug": "a", "replica": 0, "need_gb": 1, "priority": "god"},
                          {"op": "release", "key": "a[0]"}, {"op": "started", "key": "a[0]", "pid": 1},
                          *[{"op": "place", "key": f"z{n}[0]", "slug": f"z{n}", "replica": 0, "need_gb": 11}
                            for n in range(2)],
                          *[{"op": "place", "key": f"y{n}[0]", "slug": f"y{n}", "replica": 0, "need_gb": 10}
                            for n in range(6)], {"op": "release", "key": "y0[0]"})
    reasons = [r.get("reason") for r in replies]
    assert reasons[:4] == ["unknown_op", "bad_request", "bad_request", "bad_request"]
    assert reasons[5] == "not_yours" and reasons[6:8] == ["admission_refused"] * 2
    assert reasons[8] is None and reasons[13] == "too_many_asks"  # y0 placed; y1 to y4 wait: 4 per pool at most
    with socket.socket(socket.AF_UNIX) as sock:  # a line past the cap: an error, then the connection ends
        sock.connect(service.socket)
        sock.sendall(b"x" * (200 * 1024))
        assert b"bad request line" in sock.recv(4096)
    write_provider(pool_dir, "a1", GPU.format(budget=1))
    with Pool() as pool:
        assert pool.predict("a1", {"action": "echo"})["pid"]


def test_an_error_reply_never_repeats_the_clients_text(service):
    """Issue 31 finding 2: a 65,000-byte op was repeated, escaped, in a 325 KB error reply."""
    service.start()
    text = "\x7f" * 60_000
    replies = service.ask({"op": text}, {"op": "place", "key": text}, {"op": "release", "key": ["k"] * 9_000},
                          {"op": "place", "key": "a[0]", "slug": text, "replica": 0, "need_gb": 1},
                          {"op": "place", "key": "a[0]", "slug": "a", "replica": 0, "need_gb": 1, "priority": text})
    assert [r["reason"] for r in replies] == ["unknown_op"] + ["bad_request"] * 4
    assert max(len(json.dumps(r)) for r in replies) < 1024, replies


@pytest.mark.reliability
def test_a_booking_cannot_be_named_on_a_process_its_pool_did_not_start(service, security_row, reliability_row):
    """Issue 31 finding 5: a 1 GB booking named on a `sleep 100000` of the same user outlived its pool by more than
    15 minutes. The asking pool here is a process of its own; the sleep is not its child."""
    service.start()
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        asks = [{"op": "place", "key": "a[0]", "slug": "a", "replica": 0, "need_gb": 1},
                {"op": "started", "key": "a[0]", "pid": sleeper.pid}]
        done = subprocess.run([sys.executable, "-c", PROBE, service.socket, json.dumps(asks)], capture_output=True,
                              text=True, timeout=60, check=True)
        placed, named = json.loads(done.stdout)
        assert placed["placed"] and named.get("reason") == "not_yours", named
        assert "not a process this pool started" in named["error"]
        wait_until(lambda: service.ask({"op": "status"})[0]["entries"] == [], timeout=10,
                   message="the asking pool's booking to go with it")
    finally:
        sleeper.kill()
        sleeper.wait()
    security_row("a pool names its user's `sleep` as the worker holding a booking",
                 "refused (not_yours): only a process the pool started holds it", got="nothing")
    reliability_row("service booking named on a non-worker", "refused (not_yours); the booking went "
                    "with its pool; a dead pool's worker holds one orphan_grace_s at most")


# -- real users ------------------------------------------------------------------------------------------------
OTHER_POOL = textwrap.dedent("""
    import json, sys
    from resident_pool import Pool
    slug, priority, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
    pool = Pool()
    with pool.session(slug, priority=priority) as session:
        answer = session.predict({"action": "sleep", "seconds": hold})
        print(json.dumps({"pid": answer["pid"], "priority": session.priority}), flush=True)
""")

PROBE = textwrap.dedent("""
    import json, socket, sys
    path, messages = sys.argv[1], json.loads(sys.argv[2])
    try:
        s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(path)
    except OSError as exc:
        print(json.dumps({"denied": str(exc)})); sys.exit(0)
    out, buf = [], b""
    for n, message in enumerate(messages):
        s.sendall((json.dumps({"id": n, **message}) + "\\n").encode())
        while b"\\n" not in buf:
            buf += s.recv(65536)
        line, buf = buf.split(b"\\n", 1)
        out.append(json.loads(line))
    print(json.dumps(out))
""")


class OtherUser:
    """A real local user running its own pool through the service: system python, this checkout on the path."""

    def __init__(self, name: str, manifests: Path, service: Service, tag: str) -> None:
        info = pwd.getpwnam(name)
        self.name = name
        self.home = Path(tempfile.mkdtemp(prefix="rp-u-"))
        os.chown(self.home, info.pw_uid, info.pw_gid)
        self.home.chmod(0o700)
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "PYTHONPATH": f"{ROOT}:{SITE}",
                    "RESIDENT_POOL_STATE_DIR": str(self.home / "s"), "RESIDENT_POOL_LOG_DIR": str(self.home / "l"),
                    "RESIDENT_POOL_CACHE_DIR": str(self.home / "c"), "RESIDENT_POOL_MANIFESTS": str(manifests),
                    "RESIDENT_POOL_ADMISSION_SERVICE": service.socket, "RESIDENT_POOL_QUIET_EXIT_S": "60",
                    "RESIDENT_POOL_GPU_HEADROOM_GB": "0", TAG_VARIABLE: tag}

    def run(self, code: str, *args: str, groups: bool = True, **kw) -> subprocess.Popen:
        who = ["--init-groups"] if groups else ["--clear-groups"]
        return subprocess.Popen(["setpriv", f"--reuid={self.name}", f"--regid={self.name}", *who, SYSTEM_PYTHON,
                                 "-c", code, *args], env=self.env, cwd=self.home, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)

    def stop(self) -> None:
        pid_file = self.home / "s" / "pool.pid"
        if pid_file.exists():
            pid = int(pid_file.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
                wait_until(lambda: not pid_alive(pid), timeout=30, message="the other user's pool to stop")
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture
def shared(tmp_path):
    """A manifests folder every user can read (root's, so every pool trusts it)."""
    folder = Path(tempfile.mkdtemp(prefix="rp-m-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def other(other_user, service_group, service, shared):
    subprocess.run(["usermod", "-a", "-G", service_group, other_user], check=True)
    subprocess.run(["usermod", "-a", "-G", service_group, "root"], check=True)
    probe = subprocess.run(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups",
                            SYSTEM_PYTHON, "-c", "import resident_pool.server.pool"],
                           env={"PYTHONPATH": f"{ROOT}:{SITE}"}, capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"another user cannot run this checkout with {SYSTEM_PYTHON}: {probe.stderr[-300:]}")
    user = OtherUser(other_user, shared, service, os.environ[TAG_VARIABLE])
    yield user
    user.stop()


def test_quotas_and_class_caps_hold_across_two_real_users_pools(other, service, shared, monkeypatch):
    service.start(f"""
        [default]
        classes = ["normal", "batch"]
        [users.root]
        classes = ["interactive", "normal", "batch"]
        [groups.{service.group}]
        gpu_gb = 8
        """)
    monkeypatch.setenv("RESIDENT_POOL_MANIFESTS", str(shared))
    write_provider(shared, "a6", GPU.format(budget=6))
    write_provider(shared, "c3", GPU.format(budget=3))
    with Pool() as pool, pool.session("a6", priority="interactive") as held:
        assert held.predict({"action": "echo"})["pid"] and held.priority == "interactive"
        theirs = other.run(OTHER_POOL, "c3", "interactive", "0")
        why = wait_until(lambda: [w["why"] for w in service.ask({"op": "status"})[0]["over_quota"]],
                         timeout=60, message="the other user's request to wait over the group's quota")
        assert f"group {service.group} holds 6 of its 8 GB quota" in why[0]
        assert theirs.poll() is None
        held.release()
        pool.stop("a6")  # a warm worker holds its budget (and counts against the quota) until it stops
    out, err = theirs.communicate(timeout=60)  # the group has room again
    assert theirs.returncode == 0, err
    assert json.loads(out)["priority"] == "normal"  # asked interactive; this user may claim normal at most
    users = {pwd.getpwuid(os.getuid()).pw_name, other.name}
    for state in service.states():
        assert sum(e["budget_gb"] for e in state) <= 10 and sum(e["budget_gb"] for e in state if e["user"] in users) <= 8


def test_a_user_cannot_release_or_take_over_another_users_entry_and_one_outside_the_group_cannot_connect(
        other, service, pool_dir):
    service.start()
    write_provider(pool_dir, "a6", GPU.format(budget=6))
    with Pool() as pool, pool.session("a6") as held:
        held.predict({"action": "echo"})
        (mine,) = pool.status()["ledger"]
        attack = [{"op": "release", "key": "a6[0]"}, {"op": "withdraw", "key": "a6[0]"},
                  {"op": "started", "key": "a6[0]", "pid": os.getpid()}]
        probe = other.run(PROBE, service.socket, json.dumps(attack))
        out, _ = probe.communicate(timeout=60)
        replies = json.loads(out)
        assert replies[2]["reason"] == "not_yours", replies
        (still,) = pool.status()["ledger"]
        assert (still["slug"], still["pid"]) == ("a6", mine["pid"])  # untouched
        outside = other.run(PROBE, service.socket, json.dumps([{"op": "hello"}]), groups=False)
        out, _ = outside.communicate(timeout=60)
        assert "denied" in json.loads(out) and "Permission denied" in json.loads(out)["denied"]


def test_the_pools_trust_only_a_service_run_by_root_or_its_own_user(pool_dir, other, service, shared, monkeypatch):
    """A socket another (unprivileged) user serves is refused: it could tell pools to overfill the card."""
    fake = Path(tempfile.mkdtemp(prefix="rp-fake-"))
    fake.chmod(0o777)
    sock = fake / "admission.sock"
    server = other.run("import socket, sys, time\ns = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); "
                       "import os; os.chmod(sys.argv[1], 0o777); s.listen(); print('up', flush=True); time.sleep(30)",
                       str(sock))
    try:
        assert server.stdout.readline().strip() == "up"
        monkeypatch.setenv("RESIDENT_POOL_ADMISSION_SERVICE", str(sock))
        from resident_pool.admission.remote import connect_service
        from resident_pool.settings import settings

        with pytest.raises(ResidentPoolError, match="not root or the service's user: refused"):
            connect_service(settings(), lambda: None, lambda *a: None)
    finally:
        server.kill()
        server.communicate()
        shutil.rmtree(fake, ignore_errors=True)


# -- a member that does not read ---------------------------------------------------------------------------------
FLOOD = textwrap.dedent("""
    import json, socket, sys
    path, pairs = sys.argv[1], int(sys.argv[2])
    s = socket.socket(socket.AF_UNIX); s.settimeout(30); s.connect(path)
    buf = b""
    def ask(message):
        global buf
        s.sendall((json.dumps(message) + "\\n").encode())
        while True:
            while b"\\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    raise SystemExit("the service closed the connection")
                buf += chunk
            line, buf = buf.split(b"\\n", 1)
            reply = json.loads(line)
            if "push" not in reply:
                return reply
    for n in range(pairs):
        ask({"op": "place", "id": n, "key": "x[0]", "slug": "x", "replica": 0, "need_gb": 1})
        ask({"op": "withdraw", "id": n, "key": "x[0]"})
    print("done", flush=True)
""")


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for pid {pid}")


def _never_read(sock: socket.socket, within_s: float = 60.0) -> bool:
    """Pipeline requests on ``sock`` and never read a reply: True once the service drops it, False once it stops
    reading them (a send blocked for 5 s) or ``within_s`` passed."""
    # 65,000 bytes of DEL: its reply once repeated it, escaped to 325 KB, more than the socket holds unread.
    huge = json.dumps({"op": "\x7f" * 65_000, "id": 3}, ensure_ascii=False).encode() + b"\n"
    hellos = b"".join(json.dumps({"op": "hello", "id": n}).encode() + b"\n" for n in range(100))
    sock.setblocking(False)
    pending, blocked_since, deadline = huge, None, time.monotonic() + within_s
    while time.monotonic() < deadline:
        pending = pending or hellos  # whole lines only: a torn one would be refused for its size instead
        try:
            pending = pending[sock.send(pending):]
            blocked_since = None
        except BlockingIOError:
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 5:
                return False
            select.select([], [sock], [], 0.1)
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def _answered(user: OtherUser, path: str) -> bool:
    probe = user.run(PROBE, path, json.dumps([{"op": "hello"}]))
    out, _ = probe.communicate(timeout=30)
    return bool(out.strip()) and json.loads(out)[0].get("ok") is True


@pytest.mark.reliability
def test_a_member_who_never_reads_is_dropped_and_cannot_grow_the_services_threads_or_starve_another_user(
        other, service, reliability_row, security_row):
    """Issue 31 finding 2: a 65,000-byte op's error reply repeated it (325 KB) to a client that never read, its send
    blocked for ever, and each wake for that pool started a thread waiting behind it (300 place/withdraw pairs: 4 to
    305 threads; under a task limit the service died). Here: one connection pipelines requests it never reads, 14
    more sit open (this user's 16 in all, with the flood's), another process of this user makes 600 place/withdraw
    pairs that wake the silent one, and another user is answered throughout."""
    from resident_pool.admission.config import ServiceConfig

    service.start()
    limits = ServiceConfig()  # the defaults a user gets
    started = _threads(service.proc.pid)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(service.socket)
    idle = []
    flood = None
    try:
        send_line(silent, {"op": "place", "id": 1, "key": "fill[0]", "slug": "fill", "replica": 0, "need_gb": 10})
        send_line(silent, {"op": "place", "id": 2, "key": "wait[0]", "slug": "wait", "replica": 0, "need_gb": 5})
        for _ in range(limits.max_connections_per_user - 2):
            idle.append(socket.socket(socket.AF_UNIX))
            idle[-1].connect(service.socket)
        dropped = _never_read(silent)
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, service.socket, "600"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        most = started
        while flood.poll() is None:
            most = max(most, _threads(service.proc.pid))
            assert _answered(other, service.socket), "another user was not answered while the flood ran"
        out, err = flood.communicate(timeout=60)
        assert flood.returncode == 0 and "done" in out, err
        most = max(most, _threads(service.proc.pid))
        assert most <= 8 + limits.max_connections, f"the service grew to {most} threads (from {started})"
        assert service.proc.poll() is None and os.path.exists(service.socket)
        assert dropped, "the service kept a connection that never read its replies (and stopped reading it)"
        said = service.ask({"op": "status"})[0]
        assert [a["slug"] for a in said["line"]] == []
        # The pool comes back: its request, asked again, says why it had left the line.
        (again,) = service.ask({"op": "place", "key": "wait[0]", "slug": "wait", "replica": 0, "need_gb": 5})
        assert not again["placed"] and "dropped" in again["why"] and "did not read" in again["why"], again
        assert len(json.dumps(again)) < 4096
    finally:
        if flood is not None and flood.poll() is None:
            flood.kill()
            flood.communicate()
        silent.close()
        for sock in idle:
            sock.close()
    reliability_row("admission service: a member never reads",
                    "dropped, its waiting request told why; another user answered throughout",
                    threads_most=most, threads_start=started)
    security_row("a group member floods the admission service and never reads",
                 "dropped; service threads bounded, other users answered", got="nothing")
