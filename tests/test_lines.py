"""The line server on its own: real sockets, one thread, peers that do not read, owners that fail, descriptors out."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from helpers import wait_until

from resident_pool.host.lines import LineServer, shown
from resident_pool.protocol import ProtocolError, bind_unix, recv_line, send_line

ROOT = Path(__file__).resolve().parents[1]


class Echo:
    """Answers each line with what it asked; records how connections ended; fails where told to."""

    def __init__(self) -> None:
        self.ended: list[tuple[int, str, bool]] = []
        self.refuse_next: BaseException | None = None
        self.ticks = 0

    def opened(self, line):
        if self.refuse_next is not None:
            error, self.refuse_next = self.refuse_next, None
            raise error
        return None

    def received(self, line, message):
        if message.get("op") == "boom":
            raise KeyError("the owner's bug")
        if message.get("op") == "big":
            return {"ok": True, "id": message.get("id"), "text": "x" * 60_000}
        return {"ok": True, "id": message.get("id"), "pid": line.peer.pid}

    def bad_line(self, line, error: ProtocolError):
        return {"ok": False, "reason": "bad_request", "error": f"bad request line: {error}"}

    def closed(self, line, why, dropped):
        self.ended.append((line.number, why, dropped))

    def tick(self, now):
        self.ticks += 1


@pytest.fixture
def served(short_tmp):
    """A line server on its own thread; stopped and closed after the test."""
    path = str(short_tmp / "l.sock")
    listener = bind_unix(path)
    handler = Echo()
    server = LineServer(listener, handler, max_line_bytes=64 * 1024, max_queued_bytes=256 * 1024,
                        send_timeout_s=1.0, tick_s=0.1)
    finished = threading.Event()
    thread = threading.Thread(target=server.serve, args=(finished,), daemon=True)
    thread.start()
    yield path, server, handler
    finished.set()
    thread.join(timeout=10)
    server.close()
    listener.close()


def _ask(path: str, *messages: dict) -> list[dict]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        buf = bytearray()
        replies = []
        for message in messages:
            send_line(sock, message)
            replies.append(recv_line(sock, buf, 1 << 20))
        return replies


def test_a_peer_that_does_not_read_is_dropped_said_why_and_the_others_are_answered_meanwhile(served):
    path, _, handler = served
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(path)
    silent.setblocking(False)
    asks = b"".join(json.dumps({"op": "big", "id": n}).encode() + b"\n" for n in range(50))
    try:
        for _ in range(40):  # more replies than its socket and the outbox hold
            try:
                silent.send(asks)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
            assert _ask(path, {"op": "hi", "id": 1})[0]["ok"]  # another peer, answered at once
        ended = wait_until(lambda: [e for e in handler.ended if e[2]], timeout=10, message="the silent peer dropped")
        assert "did not read its replies" in ended[0][1]
        assert _ask(path, {"op": "hi", "id": 2})[0]["ok"]
    finally:
        silent.close()
    assert ticks_went_on(handler)


def ticks_went_on(handler: Echo) -> bool:
    seen = handler.ticks
    return bool(wait_until(lambda: handler.ticks > seen, timeout=5, message="the owner's tick"))


def test_an_owner_that_fails_on_a_line_or_a_new_connection_costs_that_one_answer_only(served):
    path, _, handler = served
    (failed, fine) = _ask(path, {"op": "boom", "id": 1}, {"op": "hi", "id": 2})
    assert failed["reason"] == "service_error" and "the owner's bug" not in json.dumps(failed)
    assert fine["ok"]
    handler.refuse_next = RuntimeError("can't start new thread")  # what ended the service in issue 31
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        assert _ended(sock)  # that connection is closed, and said in the log
    assert _ask(path, {"op": "hi", "id": 3})[0]["ok"]


def test_a_line_past_the_cap_is_answered_then_closed_and_a_bad_one_only_answered(served):
    path, _, _ = served
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"[1]\n")
        buf = bytearray()
        assert "not an object" in recv_line(sock, buf)["error"]
        send_line(sock, {"op": "hi", "id": 1})
        assert recv_line(sock, buf)["ok"]
        sock.sendall(b"x" * (70 * 1024))
        assert "over the cap" in recv_line(sock, buf)["error"]
        assert _ended(sock)


def _ended(sock: socket.socket) -> bool:
    """The server closed it: an end of file, or a reset (it closed with part of an over-long line unread)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_a_reply_sent_later_from_another_thread_reaches_its_peer(served):
    path, server, _ = served
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(path)
        line = wait_until(lambda: list(server.lines.values()), timeout=10, message="the connection")[0]
        sender = threading.Thread(target=server.send, args=(line, {"push": "wake"}))
        sender.start()
        sender.join()
        assert recv_line(sock, bytearray()) == {"push": "wake"}


def test_shown_cuts_a_peers_text_to_its_limit():
    assert shown("\x7f" * 65_000).endswith("(260002 characters)") and len(shown("\x7f" * 65_000)) < 100
    assert shown("ping") == "'ping'"


LIMITED = textwrap.dedent("""
    import resource, sys, threading
    sys.path.insert(0, sys.argv[2])
    from resident_pool.host.lines import LineServer
    from resident_pool.protocol import bind_unix

    class Handler:
        def opened(self, line): return None
        def received(self, line, message): return {"ok": True}
        def bad_line(self, line, error): return {"ok": False}
        def closed(self, line, why, dropped): pass
        def tick(self, now): pass

    listener = bind_unix(sys.argv[1])
    server = LineServer(listener, Handler(), max_line_bytes=4096)
    import os
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, used + 4))
    print("up", flush=True)
    server.serve(threading.Event())
""")


def test_at_the_descriptor_limit_a_peer_is_told_why_and_the_server_serves_on(short_tmp):
    path = str(short_tmp / "l.sock")
    proc = subprocess.Popen([sys.executable, "-c", LIMITED, path, str(ROOT)], stdout=subprocess.PIPE, text=True)
    held = []
    try:
        assert proc.stdout.readline().strip() == "up"
        told = None
        for _ in range(12):
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(10)
            sock.connect(path)
            held.append(sock)
            send_line(sock, {"op": "hi"})
            reply = recv_line(sock, bytearray())
            if reply is None or not reply.get("ok"):
                told = reply
                break
        assert told is not None and told["reason"] == "too_many_connections", told
        for sock in held:
            sock.close()
        held.clear()
        assert wait_until(lambda: _answered(path), timeout=10, message="the server to serve again")
        assert proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        proc.kill()
        proc.communicate()


def _answered(path: str) -> bool:
    try:
        return bool(_ask(path, {"op": "hi"})[0].get("ok"))
    except (OSError, ProtocolError, TypeError, AttributeError):
        return False


def test_the_line_server_holds_no_thread_of_its_own(served):
    """One thread serves every peer: a flood of connections or messages never starts another."""
    path, _, _ = served
    before = threading.active_count()
    socks = [socket.socket(socket.AF_UNIX) for _ in range(20)]
    try:
        for sock in socks:
            sock.connect(path)
            send_line(sock, {"op": "hi"})
        for sock in socks:
            sock.settimeout(10)
            assert recv_line(sock, bytearray())["ok"]
        assert threading.active_count() == before
    finally:
        for sock in socks:
            sock.close()
    assert os.path.exists(path)
