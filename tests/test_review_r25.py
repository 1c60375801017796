"""Review r25 of issue 25 (priorities, backfill, the host admission service): reproductions.

Each test fails on the code as reviewed and passes once the defect it names is fixed. Real pools, real
workers, a real admission service process on a real socket; no GPU (declared capacities and fake NVML).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from helpers import wait_until
from providers import write_provider

from resident_pool import Pool
from resident_pool.errors import ResidentPoolError
from resident_pool.protocol import recv_line, send_line


def gpu(manifests: Path, slug: str, budget: float, timeout_s: float = 120) -> None:
    write_provider(manifests, slug, f'[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n'
                                    f"[lifecycle]\nadmission_timeout_s = {timeout_s}\n")


def _in_thread(target, outcome: dict, name: str) -> threading.Thread:
    def run():
        try:
            outcome[name] = target()
        except (ResidentPoolError, OSError) as exc:
            outcome[f"{name}_error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _predict(slug: str):
    """One Pool.predict from a client of its own, closed after (an unclosed client's sockets fail the run)."""
    with Pool() as pool:
        return pool.predict(slug, {"action": "echo"})


# -- 1. a backfilled session idle between requests holds the head of the line for ever ------------------------
def test_a_backfilled_session_idle_between_requests_gives_its_memory_back_to_the_head(pool_dir, monkeypatch):
    """Issue 25: "backfill that never delays the head by more than one request" and "a busy one's lease is
    recalled after its current request". A backfilled session with no request in flight has no current request:
    the head should get its memory at once. Reviewed code: the recall is only told to the client, which gives the
    lease back at its *next* request or when the session ends; a notebook's open session (or any client that
    simply stops asking) holds the card for as long as it likes, and the head waits out admission_timeout_s."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    gpu(pool_dir, "big", 8)
    gpu(pool_dir, "big2", 9.5, timeout_s=45)
    gpu(pool_dir, "small", 1)
    outcome: dict = {}
    with Pool() as pool, pool.session("big") as held:
        held.predict({"action": "echo"})
        big2 = _in_thread(lambda: _predict("big2"), outcome, "big2")
        try:
            wait_until(lambda: [w for w in pool.waiting() if w["slug"] == "big2" and w.get("needs_gb")],
                       timeout=30, message="big2 waiting for memory")
            with pool.session("small") as small:  # fits in the 2 GB free: backfilled ahead of big2
                assert small.backfilled
                small.predict({"action": "echo"})  # one request, then the session sits idle (a notebook)
                held.release()  # big is idle now: evicting it and taking small's 1 GB back lets big2 start
                # big2 needs 9.5 GB: big's 8, the 1 free and small's 1. small runs no request: the head should
                # wait for nothing but its cold start (an echo worker: seconds at most on a loaded machine).
                wait_until(lambda: "big2" in outcome or "big2_error" in outcome, timeout=20,
                           message="big2 to be served while the backfilled small session sits idle")
                assert "big2" in outcome, outcome
        finally:
            held.release()
            big2.join(90)


# -- 2. the one ledger oversubscribes the card when anything outside it holds memory ---------------------------
class _Service:
    """The host admission service as a plain process, fake NVML readings, root's own group."""

    def __init__(self, nvml: dict, extra: str = "") -> None:
        import grp

        self.folder = Path(tempfile.mkdtemp(prefix="rp-r25-"))
        self.folder.chmod(0o755)
        (self.folder / "run").mkdir(mode=0o755)
        (self.folder / "etc").mkdir(mode=0o755)
        self.nvml = self.folder / "nvml.json"
        self.nvml.write_text(json.dumps(nvml))
        self.socket = str(self.folder / "run" / "admission.sock")
        self.audit = self.folder / "audit.jsonl"
        config = self.folder / "etc" / "admission.toml"
        config.write_text(f'socket = "{self.socket}"\ngroup = "{grp.getgrgid(os.getgid()).gr_name}"\n'
                          f'state_dir = "{self.folder / "state"}"\naudit = "{self.audit}"\n'
                          f'fake_nvml = "{self.nvml}"\nheadroom_gb = 0\n' + extra)
        config.chmod(0o644)
        self.proc = subprocess.Popen([sys.executable, "-m", "resident_pool", "admission-service", "--config",
                                      str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_until(lambda: os.path.exists(self.socket) or self.proc.poll() is not None, timeout=30,
                       message="the admission service's socket")
            assert self.proc.poll() is None, self.proc.stdout.read()
        except BaseException:
            self.stop()
            raise

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(10)
        sock.connect(self.socket)
        return sock

    @staticmethod
    def ask(sock: socket.socket, buf: bytearray, message: dict) -> dict:
        send_line(sock, {"id": 1, **message})
        while True:
            reply = recv_line(sock, buf, 1 << 20)
            if reply is None or "push" not in reply:
                return reply

    def stop(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.communicate(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def nvml_service():
    made: list[_Service] = []

    def start(nvml: dict, extra: str = "") -> _Service:
        made.append(_Service(nvml, extra))
        return made[-1]

    yield start
    for service in made:
        service.stop()


def test_the_host_service_does_not_oversubscribe_when_memory_outside_its_ledger_is_in_use(nvml_service):
    """A 10 GB card where 3 GB are held outside the ledger (a notebook, Xorg, a pool run with
    RESIDENT_POOL_ADMISSION_SERVICE=off: NVML reads 7 GB free). Two workers are placed before either loads (NVML
    drops only when a worker loads, as in the bench's race). The room is min(total - booked, NVML free): after the
    first 6 GB, min(4, 7) = 4, so 3 GB more is placed and, once both load, 3 + 6 + 3 = 12 GB on a 10 GB card: the
    very CUDA out-of-memory the one ledger was built to prevent. Budgets booked but not yet seen by NVML must come
    off NVML's free memory (room = min(total - booked, free - booked-but-not-loaded))."""
    service = nvml_service({"devices": [{"total_gb": 10, "free_gb": 7}]})
    with service.connect() as first, service.connect() as second:
        placed = service.ask(first, bytearray(), {"op": "place", "key": "a[0]", "slug": "a", "replica": 0,
                                                  "need_gb": 6})
        assert placed["ok"] and placed["placed"], placed
        # another pool asks while a[0]'s worker is still loading (NVML still reads 7 GB free)
        other = service.ask(second, bytearray(), {"op": "place", "key": "b[0]", "slug": "b", "replica": 0,
                                                  "need_gb": 3})
    assert other["ok"], other
    assert not other["placed"], ("3 GB placed where only 1 GB will be left once a[0] loads: "
                                 "3 GB outside the ledger + 6 + 3 = 12 GB on a 10 GB card")


# -- 3. a user's section in the service's configuration drops every default it does not repeat -----------------
def test_a_users_own_section_keeps_the_defaults_it_does_not_name(nvml_service, monkeypatch):
    """docs/admission.md: "the classes they may claim are their own (or the default's)". An operator who gives one
    user more memory (`[users.root] gpu_gb = 60`) silently gives them every class (interactive included: "a user
    cannot make everything interactive" no longer holds for them) and lifts the default's replicas limit. The
    shipped example has the same trap the other way round: `[users.alice] classes = [...]` lifts alice's 40 GB
    and 4-replica quota entirely. Each field unset in a user's section should fall back to [default]'s."""
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    service = nvml_service({"devices": [{"total_gb": 80, "free_gb": 80}]},
                           '\n[default]\ngpu_gb = 40\nreplicas = 4\nclasses = ["normal", "batch"]\n'
                           f'\n[users.{me}]\ngpu_gb = 60\n')
    with service.connect() as sock:
        buf = bytearray()
        hello = service.ask(sock, buf, {"op": "hello"})
        placed = service.ask(sock, buf, {"op": "place", "key": "a[0]", "slug": "a", "replica": 0, "need_gb": 1,
                                         "priority": "interactive"})
    assert hello["ok"] and placed["ok"] and placed["placed"], (hello, placed)
    quota = hello["quota"][f"user {me}"]
    assert (quota["gpu_gb"], quota["replicas"]) == (60, 4), quota  # its own GB; the default's replicas
    assert hello["classes"] == ["normal", "batch"], hello["classes"]  # the default's classes
    assert placed["priority"] == "normal", placed  # interactive capped as for every other user
