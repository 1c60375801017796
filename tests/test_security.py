"""Trust boundaries: each test is an attack, tried as another local user, a hostile input or a container.

Trusted: the user who runs the pool. Not trusted: other local users, campaign inputs, payloads,
anything inside a container. Each attack must get nothing.
"""

from __future__ import annotations

import json
import os
import pwd
import selectors
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from helpers import as_the_pool, configured, state_dir, wait_until
from providers import write_provider

from resident_pool import ManifestError, Pool, ResidentPoolError
from resident_pool.host.procs import pid_alive
from resident_pool.protocol import recv_line, send_line

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.reliability  # `make reliability` prints the security block


def copy_echo(manifests: Path) -> Path:
    shutil.copytree(ROOT / "manifests" / "echo", manifests / "echo")
    return manifests / "echo"


def _pool_pid(state: str) -> int:
    return int(Path(state, "pool.pid").read_text())


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


# -- 1. code from the folder a client runs in ----------------------------------------------------

CLIENT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from resident_pool import Pool
    with Pool() as pool:
        print(json.dumps(pool.predict("echo", {"from": "a shared folder"})))
    """
)


def test_modules_planted_in_the_clients_folder_never_run_in_the_pool(pool_dir, tmp_path, security_row):
    copy_echo(pool_dir)
    shared = tmp_path / "shared-project"
    (shared / "resident_pool").mkdir(parents=True)
    marker = tmp_path / "pwned"
    plant = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    for name in ("typer.py", "filelock.py", "rich.py", "resident_pool/__init__.py"):
        (shared / name).write_text(plant)
    script = tmp_path / "flow.py"  # the flow lives elsewhere; only the working directory is the shared one
    script.write_text(CLIENT_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=shared, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["echo"] == {"from": "a shared folder"}
    assert not marker.exists(), f"planted code ran: {marker.read_text()}"
    security_row("typer.py / filelock.py / resident_pool/ planted in the client's folder",
                 "the pool starts with -P from its state directory: nothing there is importable")


def _shared_folder(tmp_path: Path, name: str, mode: int = 0o777) -> Path:
    """A folder another user can reach: pytest's own temp folders are 0700."""
    base = Path(tempfile.mkdtemp(prefix="rp-shared-"))
    os.chmod(base, 0o755)
    (tmp_path / f"{name}.link").symlink_to(base)  # so the test's own temp folder records where it went
    folder = base / name
    folder.mkdir()
    os.chmod(folder, mode)
    return folder


@pytest.fixture(autouse=True)
def _remove_shared_folders(tmp_path):
    yield
    for link in tmp_path.glob("*.link"):
        shutil.rmtree(link.resolve(), ignore_errors=True)


def _as(user: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30, check=False)


def test_a_worker_script_another_user_can_write_is_refused_naming_the_fix(pool_dir, other_user, security_row):
    folder = copy_echo(pool_dir)
    info = pwd.getpwnam(other_user)
    os.chown(folder / "worker.py", info.pw_uid, info.pw_gid)  # the other user's worker.py, in our manifests
    with Pool() as pool:
        with pytest.raises(ManifestError, match=r"worker\.py") as owned:
            pool.predict("echo", {"secret": "HF_TOKEN"})
        assert f"owned by uid {info.pw_uid}" in str(owned.value) and "chown" in str(owned.value)
        os.chown(folder / "worker.py", os.getuid(), os.getgid())
        os.chmod(folder / "manifest.toml", 0o666)  # anyone may rewrite what it runs
        with pytest.raises(ManifestError, match=r"manifest\.toml") as writable:
            pool.predict("echo", {})
        assert "chmod go-w" in str(writable.value)
        os.chmod(folder / "manifest.toml", 0o644)
        os.chmod(pool_dir, 0o777)  # anyone may add a provider, or replace one
        with pytest.raises(ManifestError, match="chmod go-w") as folder_error:
            pool.predict("echo", {})
        assert str(pool_dir) in str(folder_error.value)
        os.chmod(pool_dir, 0o755)
        assert pool.predict("echo", {"n": 1})["echo"] == {"n": 1}  # fixed as the message says, it serves
    security_row("another user's worker script / a group- or world-writable manifest or folder",
                 "ManifestError naming the file and the chown/chmod that fixes it; nothing ran")


def test_pinned_weights_another_user_can_write_are_refused_but_a_root_owned_store_is_used(tmp_path, other_user):
    from resident_pool.providers.launch import check_weights
    from resident_pool.providers.manifest import load_manifest
    from resident_pool.providers.weights import HashCache

    store = tmp_path / "store"
    store.mkdir()
    (store / "w.bin").write_bytes(b"weights")
    import hashlib

    digest = hashlib.sha256(b"weights").hexdigest()
    manifest = load_manifest(write_provider(tmp_path / "m", "pinned", f'[weights]\nroot = "{store}"\n'
                                            f'[[weights.files]]\npath = "w.bin"\nsha256 = "{digest}"\nsize = 7\n'))
    cache = HashCache.of(configured()[1])
    assert check_weights(manifest, cache=cache).ok  # root-owned (this test runs as root), read-only to others: usable
    info = pwd.getpwnam(other_user)
    os.chown(store / "w.bin", info.pw_uid, info.pw_gid)
    with pytest.raises(ManifestError, match=r"w\.bin.*chown"):
        check_weights(manifest, cache=cache)
    os.chown(store / "w.bin", 0, 0)
    os.chmod(store, 0o777)
    with pytest.raises(ManifestError, match="chmod go-w"):
        check_weights(manifest, cache=cache)


# -- 2. a process inside a container ----------------------------------------------------------------

def test_a_container_sees_its_own_socket_folder_not_the_pools(engines, pool_dir, isolated_dirs, security_row):
    from providers import WORKERS

    folder = pool_dir / "boxed"
    folder.mkdir()
    shutil.copy(WORKERS / "inside.py", folder / "worker.py")
    (folder / "manifest.toml").write_text(
        'slug = "boxed"\nworker = "worker.py"\n[env]\nkind = "container"\nengine = "docker"\n'
        'image = "standin/py:3"\npython = "/usr/bin/python3"\n')
    copy_echo(pool_dir)
    state = Path(isolated_dirs["state"])
    with Pool() as pool:
        pool.predict("echo", {})
        echo_socket = next(w["socket"] for w in pool.status()["workers"] if w["slug"] == "echo")
        secrets = [str(state / "pool.sock"), str(state / "ledger.json"), echo_socket, str(pool_dir / "echo")]
        seen = pool.predict("boxed", {"action": "exists", "paths": secrets})
        own = next(w["socket"] for w in pool.status()["workers"] if w["slug"] == "boxed")
        assert seen == dict.fromkeys(secrets, False)
        assert pool.predict("boxed", {"action": "exists", "paths": [own]}) == {own: True}
    security_row("a process inside a container reaching for the pool socket, ledger, other workers",
                 "only its own run folder is mounted; none of them exist in there")


# -- 3. provider names that are paths -------------------------------------------------------------

def test_a_provider_name_is_a_slug_never_a_path(pool_dir, tmp_path, security_row):
    copy_echo(pool_dir)
    elsewhere = tmp_path / "elsewhere" / "manifests"
    copy_echo(elsewhere)
    with Pool() as pool:
        real = pool.predict("echo", {})["pid"]
        for name in ("../elsewhere/manifests/echo", "echo/../echo", "/etc", "ECHO", "echo\n"):
            with pytest.raises(ResidentPoolError, match="not a slug") as info:
                pool.predict(name, {})
            assert info.value.reason == "bad_request"
        with Pool(manifests=elsewhere) as impostor, pytest.raises(ManifestError) as clash:
            impostor.predict("echo", {})
        assert str(pool_dir) in str(clash.value) and str(elsewhere) in str(clash.value)
        assert pool.predict("echo", {})["pid"] == real  # the real echo kept its socket and its clients
    security_row("provider name ../../x/manifests/echo; the same slug from another folder",
                 "refused as not a slug; one slug is served from one folder")


# -- 4. secrets in the environment of whoever started the pool ---------------------------------------

SECRET_CLIENT = textwrap.dedent(
    """
    import json, sys
    from resident_pool import Pool
    with Pool() as pool:
        print(json.dumps(pool.predict(sys.argv[1], {"action": "env"})["env"]))
    """
)


def test_a_secret_of_the_client_that_started_the_pool_reaches_no_worker(pool_dir, security_row):
    write_provider(pool_dir, "plain", "")
    write_provider(pool_dir, "named", '[env]\npassthrough = ["HF_TOKEN"]\n')
    env = {**os.environ, "PREFECT_API_KEY": "pnu_client_a", "HF_TOKEN": "hf_client_a", "AWS_SECRET_ACCESS_KEY": "x"}
    started = subprocess.run([sys.executable, "-c", SECRET_CLIENT, "plain"], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
    seen = json.loads(started.stdout)  # the worker's environment, in the pool client A started
    assert not {"PREFECT_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(seen)
    assert seen["PATH"] and seen["HOME"] and seen["RESIDENT_POOL_TEST_TAG"]  # the fixed base still reaches it
    named = json.loads(subprocess.run([sys.executable, "-c", SECRET_CLIENT, "named"], capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    assert named["HF_TOKEN"] == "hf_client_a"  # named by its manifest: read from the pool's environment
    assert "PREFECT_API_KEY" not in named
    security_row("PREFECT_API_KEY / HF_TOKEN in the environment of the client that started the pool",
                 "a fixed base plus each manifest's passthrough; unnamed secrets reach no worker")


# -- 5. pinned weights swapped at the same size -----------------------------------------------------------

def test_a_weight_swapped_at_the_same_size_with_its_mtime_put_back_is_caught(tmp_path, monkeypatch, security_row):
    import hashlib

    from resident_pool.providers.launch import check_weights
    from resident_pool.providers.manifest import load_manifest
    from resident_pool.providers.weights import HashCache

    monkeypatch.setenv("RESIDENT_POOL_CACHE_DIR", str(tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    pickle_file = store / "ccd.pkl"
    pickle_file.write_bytes(b"honest weights!")
    digest = hashlib.sha256(b"honest weights!").hexdigest()
    manifest = load_manifest(write_provider(tmp_path / "m", "pinned", f'[weights]\nroot = "{store}"\n'
                                            f'[[weights.files]]\npath = "ccd.pkl"\nsha256 = "{digest}"\nsize = 15\n'))
    assert check_weights(manifest, cache=HashCache.of(configured()[1])).ok  # hashed once, remembered
    before = pickle_file.stat()
    pickle_file.write_bytes(b"evil __reduce__")  # same size
    os.utime(pickle_file, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back
    assert pickle_file.stat().st_size == before.st_size and pickle_file.stat().st_mtime_ns == before.st_mtime_ns
    report = check_weights(manifest, cache=HashCache.of(configured()[1]))
    assert not report.ok and "ccd.pkl sha256" in report.problems[0]
    security_row("a pinned pickle swapped at the same size, its mtime put back",
                 "the hash cache keys on device, inode, size, mtime and ctime: re-hashed, refused")


# -- 7. a connection flood under a low descriptor limit -----------------------------------------------------

FLOOD_STARTER = textwrap.dedent(
    """
    import json, resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # the pool it starts inherits the low limit
    from resident_pool import Pool
    with Pool() as pool:
        print(json.dumps(pool.predict("echo", {})["pid"]))
    """
)


def test_a_connection_flood_neither_kills_the_pool_nor_its_warm_workers(pool_dir, isolated_dirs, security_row):
    copy_echo(pool_dir)
    worker = json.loads(subprocess.run([sys.executable, "-c", FLOOD_STARTER], capture_output=True, text=True,
                                       timeout=120, check=True).stdout)
    pool_pid = _pool_pid(isolated_dirs["state"])
    flood = []
    try:
        for _ in range(300):  # far past the pool's 64 descriptors
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(5)
            try:
                sock.connect(os.path.join(isolated_dirs["state"], "pool.sock"))
            except OSError:
                sock.close()
                continue
            flood.append(sock)
        pool_log = Path(isolated_dirs["logs"]) / "pool.log"
        wait_until(lambda: "out of file descriptors" in pool_log.read_text(), timeout=30,
                   message="the pool to run out of descriptors")
        assert pid_alive(pool_pid)
        # Past its limit, the pool's reserve descriptor lets it tell a client why it is turned away.
        told = wait_until(lambda: _one_told(flood), timeout=30, message="a client told it was turned away")
        assert told["reason"] == "too_many_connections" and "descriptors" in told["error"]["error"]
    finally:
        for sock in flood:
            sock.close()
    with Pool() as pool:
        answer = wait_until(lambda: _try_predict(pool), timeout=30, message="the pool to serve again")
    assert answer["pid"] == worker and pid_alive(pool_pid)
    security_row("300 connections against a pool limited to 64 descriptors",
                 "clients past the limit told why (a reserve descriptor); the same warm worker serves after")


def _one_told(flood: list[socket.socket]) -> dict | None:
    for sock in flood:
        sock.setblocking(False)
        try:
            data = sock.recv(65536)
        except (BlockingIOError, OSError):
            continue
        for line in data.splitlines():
            reply = json.loads(line)
            if reply.get("ok") is False:
                return reply
    return None


def _try_predict(pool: Pool):
    try:
        return pool.predict("echo", {"after": "flood"})
    except (OSError, ResidentPoolError):
        pool.close()
        return None


# -- 8. a malformed or foreign release ------------------------------------------------------------------------

def _raw(state: str) -> tuple[socket.socket, bytearray]:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(os.path.join(state, "pool.sock"))
    buf = bytearray()
    send_line(sock, {"op": "hello", "version": __import__("resident_pool").__version__})
    assert recv_line(sock, buf)["ok"]
    return sock, buf


def test_a_malformed_or_foreign_release_changes_nothing(pool_dir, isolated_dirs, security_row):
    write_provider(pool_dir, "solo", "[lifecycle]\nadmission_timeout_s = 2\n")
    with Pool() as pool:
        pool.predict("solo", {"action": "echo"})
        holder, hbuf = _raw(isolated_dirs["state"])
        send_line(holder, {"op": "acquire", "slug": "solo", "manifests": str(pool_dir)})
        lease = recv_line(holder, hbuf)["lease"]
        for bad in ({"lease": lease, "served": "many"}, {"lease": str(lease)}, {"lease": lease, "outcome": "gone"},
                    {"lease": lease, "reply": "not a dict", "outcome": "exiting"}):
            send_line(holder, {"op": "release", **bad})
            reply = recv_line(holder, hbuf)
            assert not reply["ok"] and reply["reason"] == "bad_request", (bad, reply)
        thief, tbuf = _raw(isolated_dirs["state"])
        send_line(thief, {"op": "release", "lease": lease, "outcome": "broken"})
        assert recv_line(thief, tbuf)["reason"] == "bad_request"
        (worker,) = pool.status()["workers"]
        assert worker["state"] == "leased" and worker["lease"]["id"] == lease  # still the holder's
        started = time.monotonic()
        with pytest.raises(ResidentPoolError, match="waited") as waited:  # replica waits have a deadline
            pool.predict("solo", {"action": "echo"})
        assert waited.value.reason == "admission_timeout" and time.monotonic() - started < 15
        send_line(holder, {"op": "release", "lease": lease, "outcome": "ok", "served": 0})
        assert pool.predict("solo", {"action": "echo"})["echo"] is None  # the rightful release frees it
        holder.close()
        thief.close()
    security_row("a release with bad fields; a release of someone else's lease",
                 "bad_request before any change; the lease stays its holder's; waits end at their deadline")


# -- 9. markdown and rich markup in what a worker prints -----------------------------------------------------

def test_markdown_in_an_error_or_a_transcript_cannot_escape_its_artifact(tmp_path, security_row):
    from resident_pool.errors import WorkerRequestError
    from resident_pool.prefect import _markdown

    tail = ["normal line", "```", "# Click here", "[login](https://evil.example/steal)", "````` and more"]
    error = WorkerRequestError("demo: request failed: <img src=x onerror=alert(1)> **bold** | pipe",
                               slug="demo", transcript=str(tmp_path / "t.log"), transcript_tail=tail)
    text = _markdown(error, 20, configured()[1])
    fence = next(line for line in text.splitlines() if line.startswith("`") and set(line) == {"`"})
    assert len(fence) > 5  # longer than any run of backticks inside the tail
    body = text.split(fence)[1]
    assert "[login](https://evil.example/steal)" in body  # verbatim, inside the fence: inert
    outside = text.replace(body, "")
    assert "<img" not in outside and "**bold**" not in outside and "\\*\\*bold\\*\\*" in outside
    security_row("markdown, HTML and a closing fence in an error or a transcript line",
                 "escaped outside, verbatim inside a fence longer than any backtick run in it")


def test_a_line_break_in_a_worker_chosen_value_stays_inside_its_table_row(tmp_path, security_row):
    from resident_pool.errors import WorkerRequestError
    from resident_pool.prefect import _markdown

    # The client copies a failed reply's "reason" as is; a hostile worker picks it.
    reason = "request_failed\n\nSession expired\n===\n\nSign in again at https://evil.example/login\n"
    error = WorkerRequestError("boxed: request failed: x\n# Heading", slug="boxed", reason=reason,
                               transcript=str(tmp_path / "t.log"))
    text = _markdown(error, 20, configured()[1])
    loose = [line for line in text.splitlines() if line and not line.startswith("|")]
    assert not [line for line in loose if "===" in line or "evil.example" in line or "Heading" in line], text
    row = next(line for line in text.splitlines() if line.startswith("| reason |"))
    assert "===" in row and "https://evil.example/login" in row
    security_row("a line break in a worker's reason or error", "kept on its table row or line; no markdown starts")


@pytest.mark.usefixtures("prefect_harness")
def test_the_failure_artifacts_description_is_escaped_like_its_body(monkeypatch):
    from prefect import flow, task

    import resident_pool.prefect as helpers
    from resident_pool.errors import WorkerRequestError

    made = []
    monkeypatch.setattr(helpers, "create_markdown_artifact", lambda **kwargs: made.append(kwargs))
    worker_error = "ValueError: bad residue in [Sign in](https://evil.example/login) ![](https://evil.example/t.png)"
    error = WorkerRequestError(f"loud: request failed: {worker_error}\x1b[2J", slug="loud",
                               reason="request_failed", transcript="/x.log")

    @task
    def fails():
        return helpers._report(error, 20, helpers.host_settings()[1])

    @flow
    def reports():
        return fails()

    reports()
    description = made[0]["description"]  # the task run's Artifacts tab renders it as markdown
    assert "[Sign in](" not in description and "![](" not in description and "\x1b" not in description
    assert "\\[Sign in\\](https://evil.example/login)" in description


def test_logs_takes_a_provider_name_and_reads_only_the_pools_own_transcripts(isolated_dirs, security_row):
    cli = str(Path(sys.executable).with_name("resident-pool"))
    logs = Path(isolated_dirs["logs"])
    secret = Path(tempfile.mkdtemp(prefix="rp-secret-", dir=logs.parent))
    try:
        (secret / "a-1.log").write_text("not a transcript\n")
        (logs / "b-0-20260101-000000-abcdef.log").symlink_to(secret / "a-1.log")  # planted in the log folder
        outside = subprocess.run([cli, "logs", f"../{secret.name}/a"], capture_output=True, text=True,
                                 timeout=60, check=False)
        linked = subprocess.run([cli, "logs", "b"], capture_output=True, text=True, timeout=60, check=False)
    finally:
        shutil.rmtree(secret)
    assert outside.returncode == 2 and "is not a provider name" in outside.stderr
    assert linked.returncode == 1 and "not a transcript" not in linked.stdout + linked.stderr
    markup = subprocess.run([cli, "logs", "[/x]"], capture_output=True, text=True, timeout=60, check=False)
    assert markup.returncode == 2 and "MarkupError" not in markup.stderr
    security_row("`resident-pool logs` with a path or markup for SLUG; a link planted among transcripts",
                 "refused as not a provider name; the link is not followed")


def test_check_prints_a_workers_error_without_its_terminal_escapes(pool_dir):
    write_provider(pool_dir, "loud", '[smoke]\npayload = { action = "raise", message = '
                                     '"\\u001b]0;owned-title\\u001b\\\\ \\u001b[2J \\u009b31m hidden" }\n')
    done = subprocess.run([str(Path(sys.executable).with_name("resident-pool")), "check", "--smoke", "loud"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "owned-title" in done.stdout  # the text is there, inert
    assert "\x1b" not in done.stdout and "\x9b" not in done.stdout


def test_warm_takes_only_a_whole_provider_name(pool_dir):
    write_provider(pool_dir, "echo", "")
    with Pool() as pool, pytest.raises(ResidentPoolError, match="not a slug") as refused:
        pool.warm("echo/../echo")
    assert refused.value.reason == "bad_request"


def test_a_variable_name_with_a_trailing_newline_is_not_a_variable_name(pool_dir):
    write_provider(pool_dir, "env", '[env]\npassthrough = ["HOME\\n"]\n')
    with pytest.raises(ManifestError, match="is not an environment variable name"):
        from resident_pool.providers.manifest import load_manifest

        load_manifest(pool_dir / "env" / "manifest.toml")


def test_rich_markup_in_a_transcript_line_does_not_break_status_or_predict(pool_dir, tmp_path):
    write_provider(pool_dir, "loud", "")
    env = {**os.environ, "COLUMNS": "300"}
    with Pool() as pool:
        pool.predict("loud", {"action": "echo"})
        with pytest.raises(ResidentPoolError):
            pool.predict("loud", {"action": "raise", "message": "[/model] [bold red]x\x1b[2J\x07"})
    status = subprocess.run([sys.executable, "-m", "resident_pool", "status"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    failed = subprocess.run([sys.executable, "-m", "resident_pool", "predict", "loud", "--payload",
                             json.dumps({"action": "raise", "message": "[/model] \x1b[2J"})], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert failed.returncode == 1 and "MarkupError" not in failed.stderr + failed.stdout
    assert "[/model]" in failed.stdout + failed.stderr and "\x1b" not in failed.stdout + failed.stderr


# -- 10. peers that are not who they seem --------------------------------------------------------------------

FAKE_POOL = textwrap.dedent(
    """
    import os, socket, sys
    uid = int(sys.argv[2])
    os.setgid(uid); os.setuid(uid)  # before listen(): the socket's peer credentials are this user's
    server = socket.socket(socket.AF_UNIX)
    server.bind(sys.argv[1]); os.chmod(sys.argv[1], 0o777); server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        data = conn.recv(65536)
        with open(sys.argv[3], "ab") as stolen:
            stolen.write(data)
        conn.sendall(b'{"ok": true, "version": "%s", "idle": false, "draining": false, "pid": 1}\\n' % sys.argv[4].encode())
    """
)


def test_a_socket_served_by_another_user_is_never_spoken_to(isolated_dirs, tmp_path, other_user, security_row):
    import resident_pool

    info = pwd.getpwnam(other_user)
    drop = _shared_folder(tmp_path, "drop")  # where the other user can make a socket
    stolen = drop / "stolen"
    stolen.touch()
    os.chmod(stolen, 0o666)
    fake = subprocess.Popen([sys.executable, "-c", FAKE_POOL, str(drop / "pool.sock"), str(info.pw_uid), str(stolen),
                             resident_pool.__version__], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "ready"
        # The state directory passed its check, then the socket inside it was swapped (a TOCTOU).
        os.rename(drop / "pool.sock", state_dir() / "pool.sock")
        with Pool(start=False) as pool, pytest.raises(ResidentPoolError, match=f"uid {info.pw_uid}") as info_error:
            pool.status()
        assert info_error.value.reason == "peer_not_you"
        assert stolen.read_bytes() == b""  # not even the hello was sent
    finally:
        fake.kill()
        fake.wait()
        fake.stdout.close()  # else its pipe is closed by the garbage collector, in whichever test runs then
    security_row("a pool socket served by another user (swapped in after the directory check)",
                 "SO_PEERCRED checked on every connect: refused before a byte was sent")


def test_a_transcript_path_outside_the_log_directory_is_never_read(tmp_path, security_row):
    from resident_pool.errors import WorkerStartError
    from resident_pool.prefect import _markdown

    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----\nsecret")
    error = WorkerStartError("demo: the worker exited", slug="demo", transcript=str(secret))
    text = _markdown(error, 20, configured()[1])
    assert "PRIVATE KEY" not in text and "outside the log directory" in text
    security_row("a reply naming ~/.ssh/id_rsa as its transcript", "not read: transcripts only from the log directory")


# -- 11. same-user exhaustion -----------------------------------------------------------------------------------

def test_idle_connections_and_unterminated_lines_cannot_exhaust_the_pool(pool_dir, isolated_dirs, monkeypatch,
                                                                        security_row):
    """RESIDENT_POOL_MAX_CONNECTIONS = 32 so the cap is reached within the test."""
    monkeypatch.setenv("RESIDENT_POOL_MAX_CONNECTIONS", "32")
    copy_echo(pool_dir)
    with Pool() as pool:
        pool.predict("echo", {})
        pool_pid = _pool_pid(isolated_dirs["state"])
        rss = _rss_mb(pool_pid)
        idle = []
        try:
            for _ in range(60):
                sock = socket.socket(socket.AF_UNIX)
                sock.settimeout(10)
                sock.connect(pool.socket_path)
                idle.append(sock)
            assert len(_told_the_cap(idle, at_least=60 - 32)) >= 60 - 32
            with Pool(start=False) as turned_away, pytest.raises(ResidentPoolError) as info:
                turned_away.status()  # the pool's own reason, not a story about versions
            assert info.value.reason == "too_many_connections", str(info.value)
            assert _threads(pool_pid) <= 32 + 8
            for sock in idle[:4]:  # four unterminated lines of 2 MiB: over the control line cap
                try:
                    sock.sendall(b"x" * (2 * 1024 * 1024))
                except OSError:
                    pass  # closed on us: as it should be
            assert _rss_mb(pool_pid) - rss < 20
        finally:
            for sock in idle:
                sock.close()
        assert pool.predict("echo", {"n": 1})["echo"] == {"n": 1}
    security_row("60 idle connections; four 2 MiB unterminated lines",
                 "connections over RESIDENT_POOL_MAX_CONNECTIONS told the cap and closed; lines over 1 MiB dropped")


def _told_the_cap(socks: list[socket.socket], at_least: int, timeout: float = 30) -> set[socket.socket]:
    """The sockets the pool told ``too_many_connections``, read as their replies come, until ``at_least`` have.

    The pool accepts under load at its own pace, so no socket gets a fixed time of its own to answer.
    """
    told: set[socket.socket] = set()
    buffers = {sock: bytearray() for sock in socks}
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while len(told) < at_least and time.monotonic() < deadline and selector.get_map():
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                sock = key.fileobj
                chunk = sock.recv(65536)
                buffers[sock] += chunk
                if not chunk or b"\n" in buffers[sock]:
                    selector.unregister(sock)
                    line = bytes(buffers[sock]).split(b"\n", 1)[0]
                    if line and json.loads(line).get("reason") == "too_many_connections":
                        told.add(sock)
    return told


def test_a_client_that_never_reads_does_not_stall_the_worker_for_others(pool_dir, security_row):
    write_provider(pool_dir, "shared", "")
    with Pool() as pool:
        pool.predict("shared", {"action": "echo"})
        (worker,) = pool.status()["workers"]
        with socket.socket(socket.AF_UNIX) as greedy:
            greedy.connect(worker["socket"])
            for n in range(8):  # replies of 4 MiB each it never reads
                send_line(greedy, {"op": "predict", "id": n, "payload": {"action": "big", "bytes": 4 * 1024 * 1024}})
            wait_until(lambda: "action big" in Path(worker["transcript"]).read_text(), timeout=30,
                       message="the worker to answer the greedy client once")
            started = time.monotonic()
            assert pool.predict("shared", {"action": "echo", "value": 1})["echo"] == 1
            assert time.monotonic() - started < 5
            # Its unread replies wait on its own connection: the worker answered it once, not eight times.
            assert Path(worker["transcript"]).read_text().count("action big") == 1
    security_row("a client that sends requests and never reads the replies",
                 "its replies wait in its own buffer; others are served at once")


# -- 12. smaller ones -----------------------------------------------------------------------------------------------

def test_a_squatted_default_state_folder_does_not_stop_the_pool(tmp_path, monkeypatch, other_user, security_row):
    monkeypatch.delenv("RESIDENT_POOL_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    shared_tmp = _shared_folder(tmp_path, "tmp", 0o1777)  # a /tmp of our own, as open as the real one
    monkeypatch.setenv("TMPDIR", str(shared_tmp))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    squat = shared_tmp / f"resident-pool-{os.getuid()}"
    _as(other_user, "mkdir", "-m", "700", str(squat))  # the other user got there first
    assert squat.is_dir() and squat.stat().st_uid == pwd.getpwnam(other_user).pw_uid
    chosen = state_dir()
    assert chosen != squat and chosen.stat().st_uid == os.getuid() and str(tmp_path / "home") in str(chosen)
    security_row("another user squats /tmp/resident-pool-<uid> first",
                 "refused, and the pool uses a private folder under $HOME instead")


def test_work_jit_and_cache_folders_are_private_and_outputs_keep_the_umask(tmp_path, monkeypatch):
    from resident_pool.providers.launch import LaunchPlan
    from resident_pool.providers.manifest import load_manifest

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    manifest = load_manifest(copy_echo(tmp_path / "m") / "manifest.toml")
    plan = LaunchPlan.resolve(manifest, str(tmp_path / "w.sock"), **as_the_pool())
    assert oct(plan.work_root.stat().st_mode & 0o777) == oct(0o700)


def test_the_compose_file_binds_to_an_internal_interface_with_an_auth_string():
    compose = (ROOT / "infra" / "compose" / "docker-compose.yml").read_text()
    assert "0.0.0.0:4200" not in compose and '"${PREFECT_BIND_ADDRESS:-127.0.0.1}:4200:4200"' in compose
    assert "${PREFECT_SERVER_API_AUTH_STRING:?" in compose  # compose refuses to start without one
    # localhost may resolve to ::1, another socket, which any local user may hold first.
    assert "${PREFECT_UI_API_URL:-http://127.0.0.1:4200/api}" in compose and "//localhost" not in compose
    # The workers' URL the header gives agrees with the TLS advice: no plain http for them.
    assert "PREFECT_API_URL=https://<name>/api" in compose and "PREFECT_API_URL=http:" not in compose


# -- 6. campaign output through a planted symlink -----------------------------------------------------------

@pytest.mark.usefixtures("prefect_harness")
def test_a_campaign_never_writes_through_a_planted_symlink(pool_dir, tmp_path, security_row):
    from providers import EMBEDDER_ENV

    sys.path.insert(0, str(ROOT / "flows"))
    from screen import screen

    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    profile = tmp_path / "home" / ".bashrc"
    profile.parent.mkdir()
    profile.write_text("# the victim's shell profile\n")
    inputs = tmp_path / "hostile.fasta"
    inputs.write_text(">$(touch${IFS}/tmp/pwned)\nMKTAYIAKQRQ\n>two\nMKVLAAGIV\n")
    from resident_pool.errors import CampaignFailed

    output = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"  # where records go as chunks finish
    partial.symlink_to(profile)
    with pytest.raises(CampaignFailed, match="a symlink is never followed"):
        screen(input=str(inputs), provider="embedder", output=str(output))
    assert profile.read_text() == "# the victim's shell profile\n"
    partial.unlink()
    output.symlink_to(profile)  # planted where the finished output goes
    old_umask = os.umask(0o027)  # an analyst's group may read outputs, nobody else
    try:
        summary = screen(input=str(inputs), provider="embedder", output=str(output))
    finally:
        os.umask(old_umask)
    assert profile.read_text() == "# the victim's shell profile\n"
    assert not output.is_symlink() and summary["ok"] == 2  # the link was replaced, never followed
    assert oct(output.stat().st_mode & 0o777) == oct(0o640)
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["$(touch${IFS}/tmp/pwned)", "two"]
    assert not Path("/tmp/pwned").exists()
    security_row("campaign output planted as a symlink to ~/.bashrc; a FASTA id holding $(touch ...)",
                 "the link is replaced, never followed; ids are data; the output gets the user's umask")


# -- review round 2: what a process inside a worker can still reach -------------------------------------

HEARTBEAT_WORKER = textwrap.dedent(
    """
    import importlib.util, os, sys

    spec = importlib.util.spec_from_file_location("worker_base", os.environ["RESIDENT_POOL_WORKER_BASE"])
    wb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wb)
    # It watches its parent instead of the heartbeat, so it outlives what it does to the file.
    heartbeat = os.environ.pop("RESIDENT_POOL_HEARTBEAT")

    def on_predict(payload):
        os.unlink(heartbeat)
        if payload["plant"] == "fifo":
            os.mkfifo(heartbeat, 0o600)
        else:
            os.symlink(payload["target"], heartbeat)
        return {"heartbeat": heartbeat}

    wb.serve(slug="hostile", socket_path=sys.argv[1], on_predict=on_predict)
    """
)


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def test_a_worker_cannot_make_the_pool_touch_a_file_through_its_heartbeat(pool_dir, tmp_path, security_row):
    folder = pool_dir / "hostile"
    folder.mkdir()
    (folder / "worker.py").write_text(HEARTBEAT_WORKER)
    (folder / "manifest.toml").write_text('slug = "hostile"\nworker = "worker.py"\n')
    outside = tmp_path / "outside-the-run-folder"
    outside.mkdir()
    created = outside / "created-by-the-pool"
    existing = outside / "existing"
    existing.write_text("x")
    os.utime(existing, (1_000_000, 1_000_000))
    with Pool() as pool:
        for plant, target, touched in (("link", created, created.exists),
                                       ("link", existing, lambda: existing.stat().st_mtime != 1_000_000),
                                       ("fifo", None, lambda: False)):
            heartbeat = Path(pool.predict("hostile", {"plant": plant, "target": str(target)})["heartbeat"])
            # The pool beats every 2 s: either it put a file of its own back, or it went through the link.
            wait_until(lambda heartbeat=heartbeat, touched=touched: _regular(heartbeat) or touched(), timeout=15,
                       message=f"the pool's next heartbeat after a planted {plant}")
            assert not touched(), f"the pool followed the planted {plant} to {target}"
            assert _regular(heartbeat) and os.lstat(heartbeat).st_uid == os.getuid()
        assert pool.predict("hostile", {"plant": "link", "target": str(created)})  # still served
    assert not created.exists() and existing.stat().st_mtime == 1_000_000
    security_row("a worker (or a container) replaces its heartbeat with a link to a host file, or a FIFO",
                 "the pool never follows it: the link is removed and a file of its own made in its place")


# A worker that answers every prediction "worker_exiting" and never exits: the pool must not take its word.
LINGERING_WORKER = textwrap.dedent(
    """
    import json, os, socket, sys
    path = sys.argv[1]
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(8)
    while True:
        conn, _ = server.accept()
        buf = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            buf += chunk
            while b"\\n" in buf:
                line, buf = buf.split(b"\\n", 1)
                msg = json.loads(line)
                if msg.get("op") == "predict":
                    reply = {"ok": False, "reason": "worker_exiting", "exit_code": EXIT_CODE, "error": "bye",
                             "id": msg.get("id")}
                else:
                    reply = {"ok": True, "model": "raw", "ready": True, "uptime_s": 1, "id": msg.get("id")}
                conn.sendall(json.dumps(reply).encode() + b"\\n")
        conn.close()
    """
)


@pytest.mark.parametrize("exit_code", ['"x"', "0"])
def test_a_worker_that_says_it_is_exiting_but_lingers_is_stopped_whatever_code_it_names(pool_dir, exit_code,
                                                                                        security_row):
    folder = pool_dir / "raw"
    folder.mkdir()
    (folder / "worker.py").write_text(LINGERING_WORKER.replace("EXIT_CODE", exit_code))
    (folder / "manifest.toml").write_text('slug = "raw"\nworker = "worker.py"\n[lifecycle]\n'
                                          'admission_timeout_s = 30\n')
    with Pool() as pool:
        for _ in range(2):  # the provider is not wedged: the next request gets a worker of its own
            with pool.session("raw") as session:
                pid = session.pid
                with pytest.raises(ResidentPoolError) as said:
                    session.predict({})
            assert said.value.reason == "worker_exiting", said.value
            assert pool.status()["workers"] == []
            wait_until(lambda pid=pid: not pid_alive(pid), timeout=15, message=f"the lingering worker {pid} to end")
    security_row("a worker answers worker_exiting with a non-integer exit_code, or says it exits and stays",
                 "its code is taken only when it is an int; one still running after a short grace is stopped")


@pytest.mark.parametrize("variable", ["APPTAINER_BINDPATH", "SINGULARITY_BIND"])
def test_apptainer_binds_in_the_pools_own_environment_do_not_reach_a_container(engines, pool_dir, tmp_path, monkeypatch,
                                                                               variable, security_row):
    from providers import WORKERS

    folder = pool_dir / "boxed"
    folder.mkdir()
    shutil.copy(WORKERS / "inside.py", folder / "worker.py")
    (folder / "manifest.toml").write_text(
        'slug = "boxed"\nworker = "worker.py"\n[env]\nkind = "container"\nengine = "apptainer"\n'
        'image = "standin/py:3"\npython = "/usr/bin/python3"\n')
    secrets = tmp_path / "ssh"
    secrets.mkdir()
    (secrets / "id_ed25519").write_text("private key")
    monkeypatch.setenv(variable, str(secrets))  # left in the environment of whoever started the pool
    with Pool() as pool:
        assert pool.predict("boxed", {"action": "exists", "paths": [str(secrets / "id_ed25519")]}) == {
            str(secrets / "id_ed25519"): False}
    runs = [json.loads(line) for line in (engines / "runs.jsonl").read_text().splitlines()]
    assert runs and all(run["argv"][:2] == ["exec", "--containall"] for run in runs)
    security_row(f"{variable} in the environment of whoever started the pool (extra host folders in a container)",
                 "removed from the engine's environment; apptainer runs --containall (own PID/IPC namespaces)")


@pytest.mark.parametrize("exposed", ["state", "logs", "results", "manifests"])
def test_a_bind_or_work_root_holding_a_pool_folder_is_refused_naming_both(engines, pool_dir, isolated_dirs, exposed,
                                                                         security_row):
    from providers import WORKERS

    folder = pool_dir / "boxed"
    folder.mkdir()
    shutil.copy(WORKERS / "inside.py", folder / "worker.py")
    pool_folder = {"state": Path(isolated_dirs["state"]), "logs": Path(isolated_dirs["logs"]),
                   "results": Path(isolated_dirs["results"]), "manifests": pool_dir}[exposed]
    pool_folder.mkdir(mode=0o700, exist_ok=True)
    # A bind of its parent (binds = ["/tmp"] with the state directory in /tmp), of itself, or a work_root inside it.
    line, binds, field = {"state": ("", f'binds = ["{pool_folder.parent}"]\n', "env.binds"),
                          "logs": ("", f'binds = ["{pool_folder}:/logs:ro"]\n', "env.binds"),
                          "results": (f'work_root = "{pool_folder}/work"\n', "", "work_root"),
                          "manifests": ("", f'binds = ["{pool_folder.parent}"]\n', "env.binds")}[exposed]
    (folder / "manifest.toml").write_text(
        f'slug = "boxed"\nworker = "worker.py"\n{line}[env]\nkind = "container"\nengine = "docker"\n'
        f'image = "standin/py:3"\npython = "/usr/bin/python3"\n{binds}')
    with Pool() as pool, pytest.raises(ManifestError) as refused:
        pool.predict("boxed", {"action": "exists", "paths": [str(pool_folder)]})
    assert refused.value.details["field"] == field
    assert str(pool_folder.resolve()) in str(refused.value) and field in str(refused.value)
    assert not (engines / "runs.jsonl").exists()  # no container ran
    if exposed == "state":
        security_row("a container bind holding the state directory (binds = [\"/tmp\"]), the logs, results or "
                     "manifests; a work_root inside one", "ManifestError naming the field and the pool's folder; "
                     "no container starts")


PLANTED_TOYMODEL = """
import os
open({marker!r}, "w").write("planted toymodel ran as uid %d" % os.getuid())
def predict(x):
    return x * 2
"""


def test_a_daemon_started_by_hand_in_a_shared_folder_runs_nothing_from_it(pool_dir, isolated_dirs, tmp_path,
                                                                           monkeypatch, security_row):
    from providers import make_kit_venv

    python = make_kit_venv(tmp_path / "venv", "launchkit_opt")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("MODEL_OPT", raising=False)
    monkeypatch.delenv("MODEL_OPT_JIT_ROOT", raising=False)
    # A worker_launch kit runs `python -m launchkit_opt.worker_launch`: its sys.path starts with the folder it runs in.
    write_provider(pool_dir, "launched", f'[env]\npython = "{python}"\n[kit]\npackage = "launchkit_opt"\n'
                                         'mode = "triton"\n', worker="toyworker.py")
    project = _shared_folder(tmp_path, "project", 0o1777)  # a scratch folder the operator starts the daemon in
    marker = tmp_path / "marker"
    (project / "toymodel.py").write_text(PLANTED_TOYMODEL.format(marker=str(marker)))
    daemon = subprocess.Popen([str(Path(sys.executable).with_name("resident-pool")), "daemon", "--manifests",
                               str(pool_dir)], cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: os.path.exists(os.path.join(isolated_dirs["state"], "pool.sock")), timeout=30,
                   message="the daemon")
        with Pool(start=False) as pool:
            try:
                assert os.readlink(f"/proc/{daemon.pid}/cwd") == os.path.realpath(isolated_dirs["state"])
                assert pool.predict("launched", {"x": 2}) is not None
                (worker,) = pool.status()["workers"]
                work = tmp_path / "data" / "resident-pool" / "work" / "launched"
                assert os.readlink(f"/proc/{worker['pid']}/cwd") == str(work)
            finally:
                pool.shutdown()
    finally:
        daemon.wait(timeout=60)
    assert not marker.exists(), marker.read_text()
    security_row("a module planted in the folder a daemon is started from by hand (python -m puts it on sys.path)",
                 "the daemon runs from its state directory, each worker from its own work_root")


# -- review round 2: the folders above what the pool trusts ---------------------------------------------

@pytest.mark.parametrize("shared_with", ["others", "group"])
def test_a_manifest_under_a_folder_others_can_write_is_refused_a_sticky_one_is_not(isolated_dirs, tmp_path,
                                                                                    monkeypatch, shared_with,
                                                                                    security_row, request):
    monkeypatch.setenv("RESIDENT_POOL_QUIET_EXIT_S", "120")
    # Another user can rename manifests/ and put theirs in its place: anyone, or a lab group member.
    project = _shared_folder(tmp_path, "project", 0o777 if shared_with == "others" else 0o2775)
    if shared_with == "group":  # the other user's own group: someone besides you is in it
        other = pwd.getpwnam(request.getfixturevalue("other_user"))
        os.chown(project, os.getuid(), other.pw_gid)
    manifests = project / "manifests"
    manifests.mkdir(mode=0o755)
    copy_echo(manifests)
    with Pool(manifests=manifests) as pool:
        with pytest.raises(ManifestError) as refused:
            pool.predict("echo", {})
        assert str(project) in str(refused.value) and f"chmod go-w {project}" in str(refused.value)
        os.chmod(project, 0o1777)  # sticky: only an entry's owner may rename or replace it
        assert pool.predict("echo", {"n": 1})["echo"] == {"n": 1}
        pool.shutdown()
    security_row("your manifests folder inside a folder others can write (swapped between check and exec)",
                 "ManifestError naming that folder and `chmod go-w`; a sticky scratch folder is fine")


def test_an_interpreter_under_a_folder_others_can_write_is_refused(pool_dir, tmp_path):
    project = _shared_folder(tmp_path, "project", 0o777)
    venv = project / "venv" / "bin"
    venv.mkdir(parents=True, mode=0o755)
    os.chmod(project / "venv", 0o755)
    (venv / "python").symlink_to(sys.executable)
    write_provider(pool_dir, "plain", f'[env]\npython = "{venv / "python"}"\n')
    with Pool() as pool, pytest.raises(ManifestError) as refused:
        pool.predict("plain", {"action": "echo", "value": 1})
    assert str(project) in str(refused.value) and refused.value.details["field"] == "env.python"


def test_a_link_another_user_owns_on_the_way_to_a_worker_script_is_refused(pool_dir, tmp_path, other_user):
    folder = write_provider(pool_dir, "plain", "").parent
    real = tmp_path / "mine" / "worker.py"
    real.parent.mkdir()
    (folder / "worker.py").rename(real)
    (folder / "worker.py").symlink_to(real)  # the script is ours; the link to it is theirs, and can be re-pointed
    info = pwd.getpwnam(other_user)
    os.lchown(folder / "worker.py", info.pw_uid, info.pw_gid)
    with Pool() as pool, pytest.raises(ManifestError) as refused:
        pool.predict("plain", {"action": "echo", "value": 1})
    assert str(folder / "worker.py") in str(refused.value) and f"uid {info.pw_uid}" in str(refused.value)


def test_a_link_followed_by_dotdot_is_walked_as_the_kernel_walks_it(tmp_path):
    """``home/link/../state`` is ``evil/state`` when the link points into ``evil``: the folder others can write
    is on the way, whatever the spelling of the path says."""
    from resident_pool.host.trust import check_chain

    evil = tmp_path / "evil"
    (evil / "inner").mkdir(parents=True)
    (evil / "state").mkdir()
    evil.chmod(0o777)
    home = tmp_path / "home"
    home.mkdir()
    (home / "link").symlink_to(evil / "inner")
    with pytest.raises(ManifestError, match="writable by others"):
        check_chain(home / "link" / ".." / "state" / "pool.sock", "a state file")


@pytest.mark.parametrize(("members", "primaries", "private"), [
    ([], {"jovyan": 100, "root": 0}, True),  # Jupyter's images: jovyan alone in `users`
    (["alice"], {"jovyan": 100}, False),  # another listed member
    ([], {"jovyan": 100, "alice": 100}, False),  # another account whose primary group it is
])
def test_a_group_is_private_when_nobody_but_you_is_in_it(monkeypatch, members, primaries, private):
    """The group's member list and the password database are faked: making groups needs root and leaves traces."""
    from types import SimpleNamespace

    from resident_pool.host import trust

    monkeypatch.setattr(trust.grp, "getgrgid", lambda gid: SimpleNamespace(gr_name="users", gr_mem=members))
    monkeypatch.setattr(trust.pwd, "getpwuid", lambda uid: SimpleNamespace(pw_name="jovyan", pw_gid=100))
    monkeypatch.setattr(trust.pwd, "getpwall",
                        lambda: [SimpleNamespace(pw_name=name, pw_gid=gid) for name, gid in primaries.items()])
    assert trust._private_group(100) is private


def test_a_client_that_stops_reading_does_not_stop_keepalives_to_the_others_with_a_keepalive_of_0_2_s():
    """Beats every 0.2 s instead of 10, so they come within the test. Client A's buffer is full (it was
    stopped at a debugger during a long admission wait); client B, also waiting, still hears the pool live."""
    from resident_pool.server.wire import Connection, Keepalives

    keepalives = Keepalives(0.2)
    a_pool, a_client = socket.socketpair()
    b_pool, b_client = socket.socketpair()
    a_pool.setblocking(False)
    try:
        while True:
            a_pool.send(b'{"progress": {"alive_s": 0}}\n')
    except BlockingIOError:
        pass  # A's buffers are full: it has not read for hours
    a_pool.setblocking(True)
    release = threading.Event()

    def long_op(sock: socket.socket) -> None:
        with keepalives.during(Connection(sock)):
            release.wait(30)

    ops = [threading.Thread(target=long_op, args=(sock,), daemon=True) for sock in (a_pool, b_pool)]
    for op in ops:
        op.start()
    try:
        heard = bytearray()
        b_client.settimeout(0.5)

        def b_heard_three() -> bool:
            try:
                heard.extend(b_client.recv(4096))
            except TimeoutError:
                pass
            return heard.count(b"\n") >= 3

        wait_until(b_heard_three, timeout=10, message="three keepalives to the client that reads")
    finally:
        release.set()
        for op in ops:
            op.join(timeout=10)
        for sock in (a_pool, a_client, b_pool, b_client):
            sock.close()
    assert not any(op.is_alive() for op in ops)  # A's op ended too: no beat holds its send lock


# -- review round 3: the Prefect stack, shared inboxes, hostile workers and inputs --------------------------------

@pytest.mark.usefixtures("prefect_harness")
def test_validate_and_check_take_only_a_whole_provider_name(pool_dir, tmp_path, security_row):
    sys.path.insert(0, str(ROOT / "flows"))
    from validate import validate

    evil = copy_echo(tmp_path / "elsewhere")  # a manifest outside the providers' folder
    copy_echo(pool_dir)
    name = "../elsewhere/echo"
    assert (pool_dir / name / "manifest.toml").exists()  # the path would reach it
    state = validate(providers=[name], smoke=True, return_state=True)  # the providers: pool_dir, the worker host's
    assert state.is_failed() and "unknown provider(s) '../elsewhere/echo'" in str(state.message), state.message
    done = subprocess.run([str(Path(sys.executable).with_name("resident-pool")), "check", "--smoke",
                           "--manifests", str(pool_dir), name], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "is not a provider name" in done.stderr, done.stdout + done.stderr
    assert not Path(state_dir(), "pool.sock").exists()  # nothing was started, for either folder
    assert evil.exists()
    security_row("validate --smoke ../elsewhere/echo; resident-pool check ../elsewhere/echo",
                 "refused as not a provider name; nothing started")


SQUATTER = textwrap.dedent(
    """
    import socket, sys
    server = socket.socket()
    server.bind(("127.0.0.1", int(sys.argv[1])))
    server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        conn.recv(65536)
        body = b"resident_pool_up 1\\nresident_pool_requests_total{provider=\\"echo\\",replica=\\"0\\"} 0\\n"
        conn.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Type: text/plain\\r\\n\\r\\n" + body)
        conn.close()
    """
)


def test_a_metrics_port_another_user_took_first_is_named_loudly_and_no_metrics_are_served(
        pool_dir, isolated_dirs, monkeypatch, other_user, security_row):
    from conftest import SYSTEM_PYTHON
    from helpers import free_port

    port = free_port()
    uid = pwd.getpwnam(other_user).pw_uid
    squatter = subprocess.Popen(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups",
                                 SYSTEM_PYTHON, "-c", SQUATTER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "ready"
        monkeypatch.setenv("RESIDENT_POOL_METRICS_PORT", str(port))
        copy_echo(pool_dir)
        with Pool() as pool:
            pool.predict("echo", {})
            state = pool.status()["pool"]
    finally:
        squatter.kill()
        squatter.wait()
        squatter.stdout.close()
    assert state["metrics"] is None
    said = state["metrics_error"]
    assert f"127.0.0.1:{port} is already taken by uid {uid} ({other_user}), not this pool" in said, said
    assert "RESIDENT_POOL_METRICS_PORT" in said
    log = Path(isolated_dirs["logs"], "pool.log").read_text()
    assert f"taken by uid {uid} ({other_user})" in log
    security_row("another user listens on the metrics port first, serving resident_pool_up 1",
                 "the pool names the holder (uid) in its log and status and serves no metrics anywhere")


@pytest.mark.usefixtures("prefect_harness")
def test_links_planted_in_a_shared_inbox_leak_nothing_and_the_outputs_stay_ours(pool_dir, tmp_path, other_user,
                                                                               security_row):
    """mallory can write into the group inbox alice screens every night; she plants links to alice's files,
    to the flow's own environment, and in place of the output folder."""
    from providers import EMBEDDER_ENV

    sys.path.insert(0, str(ROOT / "flows"))
    from screen import screen

    from resident_pool.errors import CampaignFailed

    write_provider(pool_dir, "embedder", EMBEDDER_ENV, worker="embedder.py")
    home = tmp_path / "alice"
    home.mkdir(mode=0o700)
    secret = "ghp_0123456789abcdefSECRET"
    (home / ".git-credentials").write_text(f"https://alice:{secret}@github.com\n")
    (home / "private.fasta").write_text(">unpublished\nMKVLAAGIVLL\n")
    for name in (".git-credentials", "private.fasta"):
        os.chmod(home / name, 0o600)
    inbox = _shared_folder(tmp_path, "inbox", mode=0o1777)  # a drop folder: sticky, as /tmp is
    (inbox / "colleague.fasta").write_text(">shared\nMKTAYIAKQR\n")
    os.chmod(inbox / "colleague.fasta", 0o644)
    os.chown(inbox / "colleague.fasta", pwd.getpwnam(other_user).pw_uid, -1)  # a colleague's file: fine
    trap = _shared_folder(tmp_path, "trap", mode=0o777)
    for link, target in (("creds.csv", home / ".git-credentials"), ("env.csv", "/proc/self/environ"),
                         ("private.fasta", home / "private.fasta"), ("screened", trap)):
        done = _as(other_user, "ln", "-s", str(target), str(inbox / link))
        assert done.returncode == 0, done.stderr
    os.link(home / "private.fasta", inbox / "hard.fasta")  # where protected_hardlinks is off, mallory can
    with pytest.raises(CampaignFailed) as failed:
        screen(input=str(inbox), provider="embedder")
    said = str(failed.value) + json.dumps(failed.value.details)
    assert secret not in said and "PATH=" not in said and "unpublished" not in said
    for name in ("creds.csv", "private.fasta"):
        assert f"{inbox / name}: a symbolic link; an input is opened, never followed" in said
    assert f"{inbox / 'env.csv'}: lies under /proc" in said and f"{inbox / 'hard.fasta'}: has 2 hard links" in said
    assert f"is reached through the link {inbox / 'screened'}, owned by uid" in said  # the output folder
    assert list(trap.iterdir()) == []
    outbox = tmp_path / "outbox"
    summary = failed.value.details["summary"]
    with pytest.raises(CampaignFailed) as again:
        screen(input=str(inbox), output=str(outbox), provider="embedder")
    summary = again.value.details["summary"]
    assert summary["ok"] == 1 and [Path(f["file"]).name for f in summary["files"]] == ["colleague.fasta"]
    assert len(summary["refused"]) == 4 and secret not in json.dumps(summary)
    # Only the colleague's file was screened: its output and its report, nothing for a refused one.
    assert sorted(p.name for p in outbox.iterdir()) == ["colleague.fasta.embedder.jsonl",
                                                        "colleague.fasta.embedder.jsonl.report.html"]
    security_row("links planted in a shared inbox: ~/.git-credentials, /proc/self/environ, a 0600 file, "
                 "a hard link, the output folder", "each refused by name and listed; only the colleague's file "
                 "is screened; nothing quoted")
