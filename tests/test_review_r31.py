"""Review 31 (red team): probes of issue 31's fixes, each on real processes or the decision core with a fake clock.

A probe that fails here shows a defect on the current code; one that passes guards a path the suite did not cover.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider
from test_admission_service import _answered, other, service, service_group, shared  # noqa: F401 - fixtures
from test_core_admission import ask, clock, gpu, of, one, pool, prepare  # noqa: F401 - clock: a fixture
from test_pool import gpu_provider
from test_suite_machinery import HOST_SERVICE

from resident_pool import Pool
from resident_pool.host.procs import pid_alive
from resident_pool.protocol import recv_line, send_line
from resident_pool.server import actions as c
from resident_pool.server import events as ev
from resident_pool.server.actions import Policy

ROOT = Path(__file__).resolve().parents[1]


# -- the eviction rule for a kept lease whose holder is still calling (docs/admission.md) -------------------------
def _kept_lease_of_class(state, clock, key: str, connection: int, cls: str) -> c.Grant:  # noqa: F811 - the clock fixture
    actions = state.handle(clock(), ev.ClientAsked(key, connection, {}, cls, keep=True)).actions
    place = one(prepare(state, clock, one(actions, c.Start)), c.Place)
    spawn = one(state.handle(clock(), ev.BudgetPlaced(place.rid, 0)).actions, c.Spawn)
    grant = one(state.handle(clock(), ev.WorkerStarted(spawn.rid, 4000 + spawn.rid, True)).actions, c.Grant)
    assert grant.kept
    return grant


def test_an_interactive_stream_does_not_pin_its_card_for_ever_against_an_aged_waiter(clock):  # noqa: F811 - a fixture
    """docs/admission.md: a request that has waited aging_s "ranks as interactive and takes it too, so no request
    waits behind a stream for ever". A stream asked as interactive ranks at the top already: nothing can rank above
    it, so a waiter of any class, however long it has aged, is never given its memory while it calls."""
    state = pool(clock, {"k": gpu(8), "head": gpu(8)}, Policy(aging_s=10.0))
    kept = _kept_lease_of_class(state, clock, "k", 1, "interactive")
    state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 1))
    head = one(prepare(state, clock, one(ask(state, clock, "head", 2, "interactive")[1], c.Start)), c.Place)
    recalls = of(state.handle(clock(), ev.BudgetNotPlaced(head.rid, {0: 1.5})).actions, c.Recall)
    for _ in range(int(120 / 0.25)):  # 12 ageing periods of calls back to back
        clock.advance(0.25)
        looked = state.handle(clock(), ev.LeaseUsed(kept.lease, 1, 40)).actions if clock.now % 1.0 == 0 else []
        looked += state.handle(clock(), ev.Tick()).actions
        recalls += of(looked, c.Recall)
        for retry in of(looked, c.Place):
            recalls += of(state.handle(clock(), ev.BudgetNotPlaced(retry.rid, {0: 1.5})).actions, c.Recall)
    assert recalls, ("an interactive request waited 120 s (12 x aging_s) behind an interactive stream and its memory "
                     "was never taken: the stream pins its card for as long as it calls")


# -- the admission service: what one member's connection may cost it ------------------------------------------------
def _rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_a_member_who_pipelines_and_reads_cannot_grow_the_services_memory_without_bound(service):  # noqa: F811 - a fixture
    """Issue 31 asks for "a bound on what is queued per connection". The outbox has one; the inbox does not: a
    peer that reads its replies (so nothing waits for it) and writes tiny lines faster than the one thread answers
    them (at most LINES_PER_TURN a turn, while a turn reads up to 64 KB more) leaves every unanswered line in the
    service's memory. Seen here: about 10 MB a second, 45 MB to 576 MB in 40 s, for as long as the peer goes on;
    the service every user's pool waits on is then the kernel's OOM killer's to end."""
    service.start()
    pid = service.proc.pid
    base = _rss_mb(pid)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(service.socket)
    sock.settimeout(1.0)
    finished = threading.Event()

    def read_every_reply() -> None:
        while not finished.is_set():
            try:
                if not sock.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    reader = threading.Thread(target=read_every_reply, daemon=True)
    reader.start()
    lines = b"{}\n" * 100_000
    grown, deadline = 0, time.monotonic() + 20.0
    try:
        while time.monotonic() < deadline and grown < 150:
            try:
                sock.sendall(lines)
            except TimeoutError:
                pass  # the service stopped reading this peer: what a bound looks like from here
            except OSError:
                break  # dropped: a bound too
            grown = _rss_mb(pid) - base
    finally:
        finished.set()
        sock.close()
        reader.join(timeout=10)
    assert service.proc.poll() is None
    assert grown < 150, (f"one connection that pipelines and reads grew the admission service by {grown} MB "
                         f"(from {base} MB) within 20 s: its unanswered lines are kept without bound")


# -- a worker told to shut down answers every request already sent to it (finding 1) -------------------------------
def _sent_eventually_refused(sock: socket.socket, within_s: float = 30.0) -> bool:
    """Send one byte at a time on ``sock`` until the worker shuts its reading side (EPIPE): True then."""
    sock.setblocking(False)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            sock.send(b" ")
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            return True
        select.select([], [], [], 0.01)
    return False


def test_a_request_queued_at_shutdown_is_answered_though_another_client_does_not_read_its_reply(pool_dir):
    """The stopping worker answers queued requests one connection after another, and first sends each its unsent
    reply with a 5 s deadline (_LAST_REPLY_TIMEOUT_S); the pool, once its shutdown is acknowledged, waits 3 s
    (SHUTDOWN_EXIT_S) and then SIGTERMs the group. One connection of the user's that has not read an 8 MB reply
    (a flow run stopped with Ctrl-Z, a process in a debugger) holds the worker past that, and a request already
    sent on a connection after it is never answered: its client gets a reset, the symptom of finding 1."""
    write_provider(pool_dir, "echo", "")
    with Pool() as pool:
        with pool.session("echo") as session:
            worker_socket = session.lease["socket"]
        stuck = socket.socket(socket.AF_UNIX)
        later = socket.socket(socket.AF_UNIX)
        try:
            stuck.connect(worker_socket)
            send_line(stuck, {"op": "predict", "id": 1, "payload": {"action": "echo", "value": "x" * 8_000_000}})
            wait_until(lambda: select.select([stuck], [], [], 0)[0], timeout=30, message="the big reply to begin")
            later.connect(worker_socket)
            later.settimeout(10)
            send_line(later, {"op": "ping", "id": 1})
            assert recv_line(later, bytearray())["ok"]  # accepted and served: registered after the stuck one
            stopping = threading.Thread(target=pool.stop, args=("echo",))
            stopping.start()
            try:
                # The worker has acknowledged its shutdown and sits on the stuck connection's reply now.
                assert _sent_eventually_refused(stuck), "the worker never shut the stuck connection's reading side"
                try:
                    send_line(later, {"op": "predict", "id": 2, "payload": {"action": "echo", "value": 7}})
                except BrokenPipeError:  # refused before it was sent: its client knows it never ran (fixed)
                    reply = {"id": 2, "refused": "unsent"}
                else:
                    later.settimeout(15)
                    asked = time.monotonic()
                    try:
                        reply = recv_line(later, bytearray())
                    except OSError as exc:
                        reply = f"{type(exc).__name__}: {exc} after {time.monotonic() - asked:.1f} s"
            finally:
                stopping.join(timeout=60)
        finally:
            stuck.close()
            later.close()
    assert isinstance(reply, dict) and reply.get("id") == 2, (
        f"a request sent to the stopping worker was neither answered nor refused unsent ({reply!r}): another "
        "client's unread reply held the worker past the pool's SHUTDOWN_EXIT_S, and the pool ended it")


def test_kept_leases_evicted_for_each_other_and_stopped_meanwhile_answer_every_call(pool_dir, monkeypatch):
    """The bench's "2 of 3 fit" (three 8 GB providers on two 10 GB cards, one stream each) while another client
    stops one provider's workers after another every 0.4 s: recalls for eviction and for a stop meet on the same
    kept leases. Every call must be answered (a stop without --now drains: nothing it does is the caller's)."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "0:10,1:10")
    slugs = ("big-a", "big-b", "big-c")
    for slug in slugs:
        gpu_provider(pool_dir, slug, 8)  # idle_timeout_s as users get it (the bench sets 0: never retired)
    raised: list[str] = []
    answered = [0]
    lock = threading.Lock()
    done = threading.Event()

    def stream(slug: str) -> None:
        with Pool() as pool:
            for n in range(60):
                try:
                    assert pool.predict(slug, {"action": "sleep", "seconds": 0.02})["slept"] == 0.02
                    with lock:
                        answered[0] += 1
                except BaseException as exc:  # every kind is what the test counts
                    with lock:
                        raised.append(f"{slug} call {n}: {type(exc).__module__}.{type(exc).__name__}: {exc}")

    def stopper() -> None:
        with Pool() as pool:
            n = 0
            while not done.wait(0.4):
                pool.stop(slugs[n % 3])
                n += 1

    stopping = threading.Thread(target=stopper)
    threads = [threading.Thread(target=stream, args=(slug,)) for slug in slugs]
    stopping.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    done.set()
    stopping.join(timeout=60)
    assert not raised, f"{len(raised)} of 180 calls raised; first: {raised[:3]}"
    assert answered[0] == 180


# -- the manifest watch (finding 9) -------------------------------------------------------------------------------
def test_a_manifest_edited_to_an_invalid_one_serves_on_then_a_renamed_new_script_is_reached_within_seconds(pool_dir):
    """An edit that does not read leaves the old version serving (said once in the log); the next, valid edit (the
    worker script replaced by rename, as an editor or a deploy does) is still noticed by the watch and reached by a
    kept lease within a couple of seconds, though the manifest's own stamp changed twice meanwhile."""
    manifest = write_provider(pool_dir, "edited", "")
    script = manifest.parent / "worker.py"
    good = manifest.read_text()
    with Pool() as pool:
        old = pool.predict("edited", {"action": "echo"})["pid"]
        manifest.write_text(good + "this is = not [toml\n")
        broken = time.monotonic()
        while time.monotonic() - broken < 2.5:  # the watch looks once a second: it has seen the bad edit
            assert pool.predict("edited", {"action": "echo"})["pid"] == old
            time.sleep(0.05)
        replacement = script.with_name("worker.py.new")
        replacement.write_text(script.read_text() + "\n# the next version, moved into place\n")
        os.replace(replacement, script)
        manifest.write_text(good)
        edited = time.monotonic()
        while (pid := pool.predict("edited", {"action": "echo"})["pid"]) == old and time.monotonic() - edited < 10:
            time.sleep(0.05)
        took = time.monotonic() - edited
    assert pid != old and took < 5, f"the new version was reached {took:.1f} s after the edit (pid {pid}, old {old})"


# -- the suite and the host's admission configuration (finding 7) ----------------------------------------------------
def test_a_module_fixtures_pool_does_not_read_the_hosts_admission_service(tmp_path):
    """The conftest points each test at its own admission settings with a function-scoped autouse fixture; a
    module-scoped fixture runs before it, with the process's own environment. test_check.py's `against_stock` starts
    `resident-pool check` (and its pool) there: on a host with /etc/resident-pool/admission.toml and another user's
    live service, its six tests fail ("the pool could not start ... served by uid 65534"). Run here, as
    test_suite_machinery does, in a private mount namespace: nothing of the host changes."""
    if os.getuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"):
        pytest.skip("needs root, unshare and setpriv to give the host an admission service in a namespace of its own")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f"mount -t tmpfs tmpfs {tmp_path}"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace can be made here: {probe.stderr.strip()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    # As `make test` starts: none of this test's own settings (its conftest's) in the environment.
    env = {name: value for name, value in os.environ.items() if not name.startswith("RESIDENT_POOL_")}
    env["SCRATCH"] = str(scratch)
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", HOST_SERVICE, "sh",
                           sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
                           "tests/test_check.py", "-k", "changes_numerics"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0 and "1 passed" in done.stdout, (
        "test_check.py's module fixture read the host's admission service:\n" + done.stdout[-1500:])


def test_one_member_with_many_bookings_and_fifteen_connections_asking_status_cannot_starve_another_user(
        other, service):  # noqa: F811 - fixtures
    """Fairness is per connection (LINES_PER_TURN = 64 lines each a turn), and a user may hold 16: one member gets
    15/16 of the one thread. With 200 bookings of its own (no per-user count limit by default), each `status` it
    pipelines reads /proc for every entry, and a turn serves 15 x 64 of them. Seen: another connection's `hello`
    took 20.6 s, past the 10 s a pool waits for the service (remote.CALL_TIMEOUT_S), so other users' pools fail."""
    from resident_pool.admission.remote import CALL_TIMEOUT_S

    service.start()
    owner = socket.socket(socket.AF_UNIX)
    owner.connect(service.socket)
    owner.settimeout(10)
    buf = bytearray()
    for n in range(200):
        send_line(owner, {"op": "place", "id": n, "key": f"k{n}[0]", "slug": f"k{n}", "replica": 0, "need_gb": 0.01})
        assert recv_line(owner, buf)["placed"]
    finished = threading.Event()
    flooders = []

    def flood() -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(service.socket)
        flooders.append(sock)
        sock.settimeout(1)

        def read() -> None:
            while not finished.is_set():
                try:
                    if not sock.recv(1 << 20):
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        lines = b'{"op": "status", "id": 1}\n' * 500
        while not finished.is_set():
            try:
                sock.sendall(lines)
            except TimeoutError:
                continue
            except OSError:
                return

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(14)]
    for thread in threads:
        thread.start()
    slowest = 0.0
    try:
        # 8 s of probes, each a process of the other user's: on the code reviewed the first one took 20.6 s.
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and slowest < CALL_TIMEOUT_S:
            asked = time.monotonic()
            assert _answered(other, service.socket), "another user was not answered"
            slowest = max(slowest, time.monotonic() - asked)
    finally:
        finished.set()
        for thread in threads:
            thread.join(timeout=10)
        for sock in flooders:
            sock.close()
        owner.close()
    assert slowest < CALL_TIMEOUT_S / 2, (f"another user's hello took {slowest:.1f} s while one member pipelined "
                                         f"status on 14 connections (a pool gives up after {CALL_TIMEOUT_S:g} s)")


# -- a refused file's content is never quoted (finding 12) -----------------------------------------------------------
def test_a_table_without_a_sequence_column_is_refused_without_quoting_its_header_row(tmp_path):
    """Issue 31 finding 12 (issue 24 asked that a refused file's content is never quoted): `--input creds.csv` for a
    table with no sequence column printed "its header row reads 'https://user:<secret>-cell@...'". No commit after
    d3993d0 touches it: the refusal still quotes the first 40 characters of the header."""
    from resident_pool.campaigns.inputs import InputFile
    from resident_pool.errors import ResidentPoolError

    creds = tmp_path / "creds.csv"
    creds.write_text("https://user:hunter2-cell@db.example/x,token\n1,2\n")
    with pytest.raises(ResidentPoolError) as info:
        list(InputFile(creds).records())
    assert "hunter2" not in str(info.value), f"the refusal quotes the file's header row: {info.value}"



# -- a dead pool's orphans (finding 13) while a kept lease still calls them ------------------------------------------
def test_a_kept_lease_streaming_through_a_pool_sigkill_is_answered_every_call_and_ends_on_the_next_pools_worker(
        pool_dir, isolated_dirs, monkeypatch):
    """A kept lease calls its worker directly: the pool's SIGKILL leaves it calling the orphan, whose GPU budget the
    next pool (started by this client's own next notice) needs. The next pool asks the orphan to exit between two
    calls; each call must still be answered, and the stream must end up on the next pool's worker, well before the
    orphan's own 120 s grace."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    write_provider(pool_dir, "g8", '[gpu]\npolicy = "required"\nvram_budget_gb = 8\n')
    raised: list[str] = []
    with Pool() as pool:
        orphan = pool.predict("g8", {"action": "echo"})["pid"]
        dead = int(Path(isolated_dirs["state"], "pool.pid").read_text())
        os.kill(dead, signal.SIGKILL)
        started, pid = time.monotonic(), orphan
        while time.monotonic() - started < 60:
            try:
                pid = pool.predict("g8", {"action": "sleep", "seconds": 0.02})["pid"]
            except BaseException as exc:  # every kind is what the test counts
                raised.append(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
            if pid != orphan and not pid_alive(orphan):
                break
        took = time.monotonic() - started
        if pid_alive(orphan):
            os.kill(orphan, signal.SIGKILL)
    assert not raised, f"{len(raised)} calls raised; first: {raised[:3]}"
    assert pid != orphan, f"the stream still reached the dead pool's worker {took:.0f} s after the pool's SIGKILL"
