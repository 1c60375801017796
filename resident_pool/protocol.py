"""Wire framing between the pool and its workers: one JSON object per line.

Standard library only: the pool hands this file's path to each worker in
``RESIDENT_POOL_PROTOCOL``, and the worker loads it by path inside the model's
own environment, where this package is not installed.
"""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any

__all__ = [
    "AF_UNIX_PATH_MAX",
    "CONNECT_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "MAX_LINE_BYTES",
    "ProtocolError",
    "SocketPathError",
    "check_socket_path",
    "connect",
    "encode_line",
    "pop_line",
    "recv_line",
    "send_line",
]

# A line is one whole request or reply; embeddings for a large batch are a few
# MiB, so 64 MiB leaves room while bounding what a bad peer can make us hold.
MAX_LINE_BYTES = 64 * 1024 * 1024
CONNECT_TIMEOUT_S = 10.0
# A structure prediction on a long complex can take hours; this is the
# per-request ceiling unless a provider sets its own.
DEFAULT_REQUEST_TIMEOUT_S = 6 * 3600.0
# sun_path is 108 bytes on Linux, one of which is the terminating NUL.
AF_UNIX_PATH_MAX = 107
RECV_CHUNK = 256 * 1024

OPS = ("ping", "predict", "stats", "shutdown")
REASONS = ("request_failed", "worker_exiting", "unknown_op", "bad_request")


class ProtocolError(Exception):
    """A peer sent something that is not a protocol line.

    ``recoverable`` is False when the stream can no longer be framed (the peer
    closed mid-line, or a line ran past the cap) and the connection must close.
    """

    def __init__(self, message: str, *, recoverable: bool = False) -> None:
        super().__init__(message)
        self.recoverable = recoverable

    def __reduce__(self):
        return (_rebuild_protocol_error, (str(self), self.recoverable))


def _rebuild_protocol_error(message: str, recoverable: bool) -> ProtocolError:
    return ProtocolError(message, recoverable=recoverable)


class SocketPathError(ValueError):
    """A socket path that AF_UNIX cannot bind."""


def encode_line(obj: dict[str, Any]) -> bytes:
    """Encode one message; NaN and infinities are refused (JSON has neither)."""
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    raw = data.encode("utf-8") + b"\n"
    if len(raw) > MAX_LINE_BYTES:
        raise ValueError(
            f"message is {len(raw)} bytes, over the protocol cap of {MAX_LINE_BYTES} bytes; "
            "return a path to a file instead of inlining data this large"
        )
    return raw


def send_line(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(encode_line(obj))


def pop_line(buf: bytearray, max_bytes: int = MAX_LINE_BYTES, scan_from: int = 0) -> dict[str, Any] | None:
    """Take one whole message off the front of ``buf``; None if no line is complete.

    ``scan_from`` skips bytes already known to hold no newline.
    """
    newline = buf.find(b"\n", scan_from)
    if newline < 0:
        if len(buf) > max_bytes:
            buf.clear()
            raise ProtocolError(f"line is over the cap of {max_bytes} bytes; closing the stream")
        return None
    line = bytes(buf[:newline])
    del buf[: newline + 1]
    if len(line) > max_bytes:
        # Its end is known, so the stream stays framed: drop the line, keep the connection.
        raise ProtocolError(f"line of {len(line)} bytes is over the cap of {max_bytes} bytes", recoverable=True)
    return _decode(line)


def recv_line(sock: socket.socket, buf: bytearray, max_bytes: int = MAX_LINE_BYTES) -> dict[str, Any] | None:
    """Read one message; ``buf`` carries bytes past it to the next call.

    Returns None when the peer closed cleanly between messages. Never holds
    more than ``max_bytes`` + one chunk of an unterminated line.
    """
    scanned = 0
    while True:
        message = pop_line(buf, max_bytes, scanned)
        if message is not None:
            return message
        scanned = len(buf)
        chunk = sock.recv(min(RECV_CHUNK, max_bytes + 1 - len(buf)) or 1)
        if not chunk:
            if buf:
                size = len(buf)
                buf.clear()
                raise ProtocolError(f"peer closed the connection mid-message ({size} bytes unterminated)")
            return None
        buf += chunk


def _decode(line: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"line is not UTF-8: {exc}", recoverable=True) from None
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"line is not JSON: {exc}", recoverable=True) from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"line is JSON {type(obj).__name__}, not an object", recoverable=True)
    return obj


def check_socket_path(path: str | os.PathLike[str]) -> str:
    """Return ``path`` as str, or raise SocketPathError if AF_UNIX cannot bind it."""
    text = os.fspath(path)
    size = len(os.fsencode(text))
    if size > AF_UNIX_PATH_MAX:
        raise SocketPathError(
            f"socket path {text} is {size} bytes, over the AF_UNIX limit of {AF_UNIX_PATH_MAX}; "
            "set RESIDENT_POOL_STATE_DIR to a shorter directory"
        )
    return text


def bind_unix(path: str | os.PathLike[str], backlog: int = 64) -> socket.socket:
    """Bind a listening socket at ``path`` (a stale one is unlinked), mode 0600."""
    text = check_socket_path(path)
    try:
        if stat.S_ISSOCK(os.lstat(text).st_mode):
            os.unlink(text)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bind under a umask that never exposes the socket, then make it exact.
    old_umask = os.umask(0o177)
    try:
        listener.bind(text)
    finally:
        os.umask(old_umask)
    os.chmod(text, 0o600)
    listener.listen(backlog)
    return listener


def connect(path: str | os.PathLike[str], timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """Connect to a worker or pool socket; ``timeout`` bounds the connect only."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(check_socket_path(path))
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock
