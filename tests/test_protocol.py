from __future__ import annotations

import math
import socket
import threading
import time

import pytest

from resident_pool import protocol
from resident_pool.protocol import ProtocolError, SocketPathError, recv_line, send_line


@pytest.fixture
def pair():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield left, right
    left.close()
    right.close()


def test_round_trip_keeps_leftover_bytes_for_the_next_call(pair):
    left, right = pair
    left.sendall(b'{"a":1}\n{"b":')
    buf = bytearray()
    assert recv_line(right, buf) == {"a": 1}
    left.sendall(b'2}\n')
    assert recv_line(right, buf) == {"b": 2}
    assert buf == b""


def test_clean_close_between_messages_is_none(pair):
    left, right = pair
    left.close()
    assert recv_line(right, bytearray()) is None


def test_close_mid_message_is_a_protocol_error(pair):
    left, right = pair
    left.sendall(b'{"a": 1')
    left.close()
    with pytest.raises(ProtocolError, match="mid-message") as info:
        recv_line(right, bytearray())
    assert not info.value.recoverable


@pytest.mark.parametrize(
    ("line", "what"),
    [(b"not json\n", "not JSON"), (b"[1, 2]\n", "not an object"), (b'"text"\n', "not an object"),
     (b"\xff\xfe\n", "not UTF-8"), (b"[" * 100_000 + b"\n", "not JSON")],
)
def test_malformed_lines_are_recoverable_errors(pair, line, what):
    left, right = pair
    left.sendall(line + b'{"ok": true}\n')
    buf = bytearray()
    with pytest.raises(ProtocolError, match=what) as info:
        recv_line(right, buf)
    assert info.value.recoverable
    assert recv_line(right, buf) == {"ok": True}


@pytest.mark.parametrize(
    ("line", "expected"),
    [(b' {"a": 1} \t', {"a": 1}), (b'{"a": NaN, "b": [1.5, null, true, "\\u00e9"]}', None),
     (b'{"a": {"b": {}}}', {"a": {"b": {}}})],
)
def test_a_line_decodes_as_json_loads_does_around_the_fast_scan(line, expected):
    # _decode scans the line itself and gives anything the scan does not take whole (whitespace around the object)
    # to json.loads: the object is the same either way.
    decoded = protocol._decode(line)
    if expected is None:
        assert math.isnan(decoded["a"]) and decoded["b"] == [1.5, None, True, "\u00e9"]
    else:
        assert decoded == expected


@pytest.mark.parametrize(
    ("line", "words"),
    [(b'{"a": 1} x', "Extra data: line 1 column 10"), (b'{"a": ', "Expecting value: line 1 column 7"),
     ("\ufeff{}".encode(), "BOM"), (b'{"a":' * 100_000, "recursion")],
)
def test_a_bad_line_is_refused_with_json_loads_own_words(line, words):
    with pytest.raises(ProtocolError, match=words) as info:
        protocol._decode(line)
    assert info.value.recoverable


def test_line_over_the_cap_never_buffers_past_it(pair):
    left, right = pair
    cap = 1000
    sender = threading.Thread(target=lambda: left.sendall(b"x" * 50_000 + b"\n"))
    sender.start()
    buf = bytearray()
    peak = []
    real_recv_into = right.recv_into

    class Spy:
        def recv_into(self, view):
            peak.append(len(buf) + len(view))
            return real_recv_into(view)

    with pytest.raises(ProtocolError, match="over the cap") as info:
        recv_line(Spy(), buf, max_bytes=cap)
    assert not info.value.recoverable
    assert max(peak) <= cap + 1
    sender.join()


def test_cap_is_at_least_64_mib():
    assert protocol.MAX_LINE_BYTES >= 64 * 1024 * 1024


def test_nan_is_refused_when_sending(pair):
    left, _ = pair
    with pytest.raises(ValueError):
        send_line(left, {"value": math.nan})


def test_socket_path_over_the_limit_names_the_path(tmp_path):
    long_path = "/tmp/" + "d" * 120 + "/w.sock"
    with pytest.raises(SocketPathError) as info:
        protocol.check_socket_path(long_path)
    assert long_path in str(info.value)
    assert "RESIDENT_POOL_STATE_DIR" in str(info.value)
    with pytest.raises(SocketPathError):
        protocol.bind_unix(long_path)


def test_bound_socket_is_0600_and_replaces_a_stale_one(isolated_dirs):
    import os
    import stat

    from helpers import state_dir

    path = str(state_dir() / "t.sock")
    first = protocol.bind_unix(path)
    first.close()  # leaves a stale socket file behind
    assert os.path.exists(path)
    second = protocol.bind_unix(path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        client = protocol.connect(path)
        client.close()
    finally:
        second.close()


def test_a_socket_file_appears_only_once_it_listens_and_nothing_else_is_left_or_replaced(tmp_path, monkeypatch):
    """CI saw a client that found the file connect before listen() and be refused (ECONNREFUSED): the file
    appeared at bind(). Now it is renamed into place once it listens."""
    import os

    path = str(tmp_path / "w.sock")
    seen_at_listen = []

    class Watched(socket.socket):
        def listen(self, *args):
            seen_at_listen.append(os.path.exists(path))
            return super().listen(*args)

    monkeypatch.setattr(protocol.socket, "socket", Watched)
    listener = protocol.bind_unix(path)
    try:
        assert seen_at_listen == [False]
        assert os.listdir(tmp_path) == ["w.sock"]  # no temporary name left behind
        protocol.connect(path).close()
    finally:
        listener.close()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="not a socket"):
        protocol.bind_unix(tmp_path / "notes.txt")
    assert (tmp_path / "notes.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes.txt", "w.sock"]


def test_bind_unix_never_replaces_a_file_that_appears_while_it_binds(tmp_path, monkeypatch):
    """Review of the rename: the not-a-socket check came before bind, chmod and listen, and the rename after them
    replaced whatever was at the path by then (the old in-place bind() failed EADDRINUSE)."""
    import os
    import stat

    path = tmp_path / "w.sock"

    class Racing(socket.socket):
        def listen(self, *args):
            path.write_text("someone's data")  # a file put there between the check and the rename
            return super().listen(*args)

    monkeypatch.setattr(protocol.socket, "socket", Racing)
    with pytest.raises(OSError, match="not a socket"):
        protocol.bind_unix(path)
    assert stat.S_ISREG(os.lstat(path).st_mode) and path.read_text() == "someone's data"
    assert sorted(os.listdir(tmp_path)) == ["w.sock"]  # and its own temporary name is gone


def test_protocol_is_standard_library_only():
    """Loaded by path in the model's environment: it may import nothing of ours."""
    import ast
    from pathlib import Path

    import resident_pool

    package = Path(resident_pool.__file__).parent
    for name in ("protocol.py", "worker_base.py", "arrays.py"):
        tree = ast.parse((package / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in {"__future__", "typing", "collections"}, node.module
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] not in {"resident_pool", "pydantic", "prefect", "torch"}


def test_kernel_timeouts_raise_timeout_error_on_every_read_and_send(pair):
    """set_timeouts bounds a blocking socket's reads and sends in the kernel, with no poll before each: one that runs
    out is a TimeoutError, as with Python's own timeout (a session's request that outruns request_timeout_s)."""
    _left, right = pair
    protocol.set_timeouts(right, 0.05)
    assert right.gettimeout() is None  # blocking: no poll before each call
    for read in (lambda: recv_line(right, bytearray()), lambda: protocol.recv_message(right, protocol.Inbox())):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            read()
        assert 0.04 <= time.monotonic() - started < 5
    with pytest.raises(TimeoutError):  # nobody reads `left`: the send fills the socket's buffer, then times out
        protocol.send_raw(right, b"x" * (64 * 1024 * 1024))
    with pytest.raises(TimeoutError):
        send_line(right, {"blob": "x" * (8 * 1024 * 1024)})
    right.setblocking(False)  # a non-blocking socket (a worker's) still says would-block as such
    with pytest.raises(BlockingIOError):
        protocol.fill(right, protocol.Inbox())
