"""Wire framing between the pool and its workers: one JSON object per line.

Standard library only: the pool hands this file's path to each worker in
``RESIDENT_POOL_PROTOCOL``, and the worker loads it by path inside the model's
own environment, where this package is not installed.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import mmap
import os
import select
import socket
import stat
import struct
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

__all__ = [
    "AF_UNIX_PATH_MAX",
    "ATTACH_MIN_BYTES",
    "CONNECT_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "MAX_ATTACHMENTS",
    "MAX_ATTACHMENT_BYTES",
    "MAX_LINE_BYTES",
    "OPS",
    "OP_PING",
    "OP_PREDICT",
    "OP_RECALL",
    "OP_SHUTDOWN",
    "OP_STATS",
    "Attachment",
    "Inbox",
    "Message",
    "PeerError",
    "ProtocolError",
    "Slab",
    "SocketPathError",
    "check_peer",
    "check_socket_path",
    "closed",
    "connect",
    "encode_line",
    "fill",
    "make_slab",
    "peer_uid",
    "pop_line",
    "pop_message",
    "ready",
    "recv_line",
    "recv_message",
    "rights",
    "seal_memfd",
    "send_line",
    "send_raw",
    "set_timeouts",
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

# The ops by the names the original design's workers and callers use.
OP_PING, OP_PREDICT, OP_STATS, OP_SHUTDOWN = "ping", "predict", "stats", "shutdown"
# The pool takes back a lease a client kept between calls: later requests naming it are refused
# (reason ``lease_recalled``), and the answer comes once any request in flight has ended.
OP_RECALL = "recall"
OPS = (OP_PING, OP_PREDICT, OP_STATS, OP_SHUTDOWN, OP_RECALL)
REASONS = ("request_failed", "worker_exiting", "unknown_op", "bad_request", "lease_recalled", "worker_stopping")


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


def ready(obj: socket.socket | int, *, write: bool = False) -> bool:
    """Whether ``obj`` (a socket or a descriptor) can be read (or written) now without waiting; its peer's close and
    an error count as ready, as with select(). poll(), not select(): select() refuses a descriptor past 1023, and a
    pool serving hundreds of clients and workers, or a notebook, holds that many."""
    poller = select.poll()
    poller.register(obj, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(0))


def send_line(sock: socket.socket, obj: dict[str, Any]) -> None:
    raw = encode_line(obj)
    try:
        sock.sendall(raw)
    except BlockingIOError:
        if _kernel_timeout(sock):
            raise TimeoutError("timed out") from None
        raise


def set_timeouts(sock: socket.socket, seconds: float | None) -> None:
    """Bound each send and each receive on the blocking ``sock`` by ``seconds`` (None: no bound) in the kernel
    (SO_SNDTIMEO, SO_RCVTIMEO); one that runs out raises TimeoutError here, as with Python's socket timeout.

    Python's own timeout polls the socket before every send and receive: two system calls more per round trip,
    on the path of every call to a worker.
    """
    micros = 0 if seconds is None else max(1, round(seconds * 1e6))  # 0 is no bound to the kernel
    value = struct.pack("ll", *divmod(micros, 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _kernel_timeout(sock: socket.socket) -> bool:
    """Whether a send or receive on ``sock`` that would block means its kernel timeout ran out (set_timeouts): so on
    a blocking socket; a non-blocking one's is its own to handle."""
    return sock.gettimeout() is None


def pop_line(buf: bytearray, max_bytes: int = MAX_LINE_BYTES, scan_from: int = 0) -> dict[str, Any] | None:
    """Take one whole message off the front of ``buf``; None if no line is complete.

    ``scan_from`` skips bytes already known to hold no newline.
    """
    line = _take_line(buf, max_bytes, scan_from)
    return None if line is None else _decode(line)


def _take_line(buf: bytearray, max_bytes: int, scan_from: int) -> bytes | None:
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
    return line


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
        scratch = _scratch()
        try:
            got = sock.recv_into(scratch[: min(RECV_CHUNK, max_bytes + 1 - len(buf)) or 1])
        except BlockingIOError:
            if _kernel_timeout(sock):
                raise TimeoutError("timed out") from None
            raise
        if not got:
            return closed(buf)
        buf += scratch[:got]


_SCRATCH = threading.local()


def _scratch() -> memoryview:
    """This thread's buffer that reads land in before they join a connection's bytes.

    A read into a new object of RECV_CHUNK bytes costs the allocator a fresh mapping for each read (mmap, mremap,
    munmap, and a page faulted in): 60 us of a 75 us read of one short line, measured here.
    """
    scratch = getattr(_SCRATCH, "view", None)
    if scratch is None:
        scratch = _SCRATCH.view = memoryview(bytearray(RECV_CHUNK))
    return scratch


def closed(buf: bytearray) -> None:
    """The peer closed the connection: None (a clean close, between messages), or a ProtocolError for a message it
    left unterminated in ``buf``."""
    if buf:
        size = len(buf)
        buf.clear()
        raise ProtocolError(f"peer closed the connection mid-message ({size} bytes unterminated)")


# The C scanner json.loads ends in, called directly: json.loads' own steps around it (its checks, two regex matches
# for whitespace) cost about as much as the scan of a short line here. What json.loads does after its scan is done
# here after this one, so a line is scanned once whatever it holds (a junk byte after a line of up to the cap would
# otherwise cost a second scan, with the first one's objects still alive); a line the scan cannot start on
# (whitespace or a BOM first, no JSON at all) goes to json.loads, which says what is wrong.
_scan_once = json.decoder.JSONDecoder().scan_once
_WHITESPACE = json.decoder.WHITESPACE.match


def _loads(text: str) -> Any:
    """``json.loads(text)``: the same object, or the same error."""
    try:
        obj, end = _scan_once(text, 0)
    except StopIteration as stop:
        if not stop.value:
            return json.loads(text)
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    if end != len(text):
        end = _WHITESPACE(text, end).end()
        if end != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    return obj


def _decode(line: bytes) -> dict[str, Any]:
    try:
        obj = _loads(line.decode("utf-8"))
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


def bind_unix(path: str | os.PathLike[str], backlog: int = 64, mode: int = 0o600,
              gid: int | None = None) -> socket.socket:
    """Bind a listening socket at ``path`` with ``mode`` (and group ``gid``); a stale socket there is replaced.

    It is bound, given its mode and group, and listening under a name of its own in the same folder before it
    appears at ``path``: a client that finds the file finds a listener it may connect to (a connect between
    bind() and listen() is refused). A file at ``path`` that is not a socket is never replaced.
    """
    text = check_socket_path(path)
    folder = os.path.dirname(text)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temp = None
    try:
        for _ in range(8):  # a random name, never one that exists: nothing of anyone else's is unlinked
            name = os.path.join(folder, f".{os.urandom(4).hex()}.s")
            temp = name if len(os.fsencode(name)) <= AF_UNIX_PATH_MAX else text  # near the limit: in place
            if temp == text:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.lstat(text).st_mode):
                        os.unlink(text)  # a stale one
            # Bind under a umask that never exposes the socket, then make it exact.
            old_umask = os.umask(0o177)
            try:
                listener.bind(temp)
                break
            except OSError as exc:
                taken, temp = temp, None  # a name in use is someone else's: never unlinked below
                if exc.errno != errno.EADDRINUSE or taken == text:
                    raise
            finally:
                os.umask(old_umask)
        else:
            temp = None
            raise OSError(errno.EADDRINUSE, f"no free temporary name for a socket in {folder}")
        if gid is not None:
            os.chown(temp, -1, gid)
        os.chmod(temp, mode)
        listener.listen(backlog)
        if temp != text:
            _put_in_place(temp, text)
            temp = None
    except BaseException:
        listener.close()
        if temp is not None and temp != text:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        raise
    return listener


def _put_in_place(temp: str, path: str) -> None:
    """Give the socket at ``temp`` the name ``path``: a link where nothing is (it never replaces), a rename over a
    stale socket (never missing in between); anything else there is left alone and refused."""
    try:
        os.link(temp, path)
    except OSError:  # EEXIST; or no link() here (EPERM, ENOSYS, EACCES from a sandbox): the rename still works
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise OSError(errno.EADDRINUSE, f"{path} exists and is not a socket; move it away") from None
        os.replace(temp, path)
        return
    os.unlink(temp)


class PeerError(ConnectionError):
    """The process serving a socket is not who it must be (another user's)."""


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected AF_UNIX socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def connect(path: str | os.PathLike[str], timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """Connect to a worker or pool socket served by this user; ``timeout`` bounds the connect only.

    The peer is checked before a byte is sent: a socket swapped in by another user (a state
    directory under a folder others can write) gets nothing, not even a hello.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(check_socket_path(path))
        check_peer(sock, path)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def check_peer(sock: socket.socket, path: str | os.PathLike[str]) -> None:
    """Raise PeerError unless the process at the other end of ``sock`` (connected to ``path``) is this user's."""
    uid = peer_uid(sock)
    if uid != os.getuid():
        raise PeerError(f"{os.fspath(path)} is served by uid {uid}, not by you (uid {os.getuid()}); "
                        "refusing to talk to it: check who can write its folder")


# -- attachments: sealed memfds beside a line -------------------------------------
# Arrays too large for JSON text travel as memfds passed with SCM_RIGHTS beside
# the line that names them; the receiver maps them read-only, so no byte of them
# crosses the socket or is encoded. A line with attachments announces their sizes
# in its "buffers" list; a line without one is exactly what send_line writes.

# Per attachment, checked before mapping: a peer must not make us map without bound.
MAX_ATTACHMENT_BYTES = 4 * 1024**3
# Arrays smaller than this ride inline as base64: under it, making, passing,
# checking and mapping a memfd costs more than the text.
ATTACH_MIN_BYTES = 64 * 1024
# Per message. A sender packs its arrays into one memfd, so a handful is the norm.
MAX_ATTACHMENTS = 64
# A received attachment smaller than this is read into ordinary memory, not mapped. Each mapping is one
# of the process's vm.max_map_count memory maps (65530 by default) for as long as an array of it lives:
# a client holding ~65k mapped results could then allocate nothing, not even a thread's stack. Up to
# 1 MiB a copy cost 0.7-1.3x what a mapping did to receive and read, 1.8-2.4x at 16 MiB
# (bench/map_or_copy.py, a loaded 2-core host). Past half the limit every attachment is copied.
COPY_BELOW_BYTES = 1024 * 1024
# The kernel passes at most this many descriptors per sendmsg (SCM_MAX_FD); the
# receiver makes room for all of them, so none is ever dropped by a short buffer.
_SCM_MAX_FD = 253
_ANCILLARY_SPACE = socket.CMSG_SPACE(_SCM_MAX_FD * array.array("i").itemsize)
# A plain int: testing recvmsg's flags against the enum member builds an enum object (5 us a read, measured here).
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
# Python 3.11's fcntl lacks the name (Linux 5.1): no new writable mapping and no write(), while the
# mapping its owner made before sealing still writes. A buffer sealed so is reused by its owner, and
# only its owner: a receiver can read it, never change it.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
_REUSED_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
# Linux writes at most about 2 GiB per call; any size well under that will do.
_WRITE_CHUNK = 64 * 1024 * 1024
# What a receiver does with a reused buffer (sealed F_SEAL_FUTURE_WRITE, not F_SEAL_WRITE): a worker reads
# its client's in place (only that client can change it, and only between its own requests); a client
# copies a worker's out before anything reads it (the worker may still change it). Unset: refused.
IN_PLACE, COPY = "in place", "copy"


class Attachment:
    """A received descriptor, checked and mapped read-only; ``buffer`` outlives ``close()``.

    ``reused``: its sender reuses it (see Slab), so ``buffer`` is either read in place under a
    ``watch`` that says whether anything here still reads it, or (``copy``) only copied from.
    """

    __slots__ = ("address", "buffer", "copy", "fd", "reused", "size", "watch")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.buffer: Any = b""
        self.address: int | None = None  # where the mapping starts, once someone asked
        self.reused = False
        self.copy = False
        self.watch: Any = None  # a weak reference to what this message's views of a reused buffer hold

    def held(self) -> bool:
        """Whether something here still holds a view of this (reused) buffer, once the message's own are gone."""
        self.buffer = b""
        return self.watch is not None and self.watch() is not None

    def close(self) -> None:
        """Close the descriptor (once; the mapping stays valid)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Message:
    """One received line: its object, its attachments, and whether it may hold references."""

    __slots__ = ("attachments", "obj", "references")

    def __init__(self, obj: dict[str, Any], attachments: list[Attachment], references: bool) -> None:
        self.obj = obj
        self.attachments = attachments
        # False when the line's text holds no '"$' at all: no array reference to
        # look for, so a plain message is never walked.
        self.references = references

    def close(self) -> None:
        for attachment in self.attachments:
            attachment.close()


class Inbox(bytearray):
    """A connection's bytes read past the last message, and the descriptors that came with them.

    Each descriptor is queued with the stream offset where the read that brought
    it ended. The kernel attaches descriptors to the first byte of the sendmsg
    that carried them and ends a read right after those bytes, so a line's own
    descriptors are exactly those whose read ended inside that line: never
    before its first byte, never past its newline.
    """

    def __init__(self, max_attachment_bytes: int = MAX_ATTACHMENT_BYTES,
                 attach_min_bytes: int = ATTACH_MIN_BYTES, reused: str | None = None) -> None:
        super().__init__()
        self.start = 0  # stream offset of self[0]
        self.fds: deque[tuple[int, int]] = deque()
        self.max_attachment_bytes = max_attachment_bytes
        self.attach_min_bytes = attach_min_bytes
        # What the peer said about attachments in the ping (a dict, {} for "not
        # supported"); None until negotiated on this connection.
        self.peer: dict[str, Any] | None = None
        self.reused = reused  # IN_PLACE, COPY, or None: refused
        self.mappings = _MappingCache()
        # This side's own reused buffers (arrays.Slabs), for a reply that hands one back.
        self.slabs: Any = None
        # The bound set_timeouts last gave this connection's socket (a client's, to a worker): None until set.
        self.timeout: float | None = None

    def close_fds(self) -> None:
        while self.fds:
            os.close(self.fds.popleft()[1])

    def holds_buffers(self) -> bool:
        """Whether reused buffers went either way on this connection (each side keeps some until it closes)."""
        return bool(self.mappings.entries) or (self.slabs is not None and self.slabs.used)

    def buffer_bytes(self) -> int:
        """The bytes of reused buffers this connection keeps: this side's own, and the peer's it maps."""
        mapped = sum(entry[2] for entry in self.mappings.entries.values()) if self.mappings.entries else 0
        return mapped + (self.slabs.size() if self.slabs is not None else 0)

    def close(self) -> None:
        """The connection is gone: its descriptors, its cached mappings, its own buffers."""
        self.close_fds()
        mappings, slabs = getattr(self, "mappings", None), getattr(self, "slabs", None)  # also a half-made one's
        self.slabs = None
        if mappings is not None:
            mappings.clear()
        if slabs is not None:
            slabs.close()

    def __del__(self) -> None:
        # A connection dropped mid-message must not leave descriptors behind.
        self.close()


def fill(sock: socket.socket, inbox: Inbox, size: int = RECV_CHUNK) -> int:
    """One read into ``inbox``, queueing any descriptors that came with it; 0 when the peer closed."""
    scratch = _scratch()
    try:
        got, ancillary, flags, _ = sock.recvmsg_into([scratch[:size]], _ANCILLARY_SPACE, socket.MSG_CMSG_CLOEXEC)
    except BlockingIOError:
        if _kernel_timeout(sock):
            raise TimeoutError("timed out") from None
        raise
    end = inbox.start + len(inbox) + got
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            inbox.fds.extend((end, fd) for fd in fds)
    inbox += scratch[:got]
    if flags & _MSG_CTRUNC or len(inbox.fds) > _SCM_MAX_FD:
        inbox.close_fds()
        raise ProtocolError("the peer sent more descriptors than a message may carry; closing the stream")
    if not got:
        inbox.close_fds()
    return got


def pop_message(inbox: Inbox, max_bytes: int = MAX_LINE_BYTES, scan_from: int = 0) -> Message | None:
    """Take one whole message and its attachments off ``inbox``; None if no line is complete.

    Attachments are checked (a memfd sealed against writing, growing and
    shrinking, of the announced size, under the cap) before they are mapped; a
    line whose descriptors fail that is a recoverable ProtocolError, and every
    descriptor that came with it is closed.
    """
    if not inbox:  # asked once more after each line taken (by the worker), and before each read (by a client)
        return None
    line_start = inbox.start
    size = len(inbox)
    try:
        line = _take_line(inbox, max_bytes, scan_from)
    except ProtocolError:
        inbox.start += size - len(inbox)
        for fd in _take_fds(inbox, line_start, inbox.start):  # the dropped line's own
            os.close(fd)
        raise
    inbox.start += size - len(inbox)
    if line is None:
        return None
    own = _take_fds(inbox, line_start, inbox.start)
    try:
        obj = _decode(line)
        # Most lines carry no attachment: nothing to check.
        attachments = _attachments(own, obj.get("buffers", ()), inbox) if own or "buffers" in obj else []
    except BaseException:
        for fd in own:
            os.close(fd)
        raise
    return Message(obj, attachments, b'"$' in line)


def _take_fds(inbox: Inbox, line_start: int, line_end: int) -> list[int]:
    """The descriptors that came with the line [line_start, line_end); stale ones are closed."""
    own = []
    while inbox.fds and inbox.fds[0][0] <= line_end:
        end, fd = inbox.fds.popleft()
        if end > line_start:
            own.append(fd)
        else:  # came with bytes before this line and no line took it
            os.close(fd)
    return own


def _attachments(fds: list[int], sizes: Any, inbox: Inbox) -> list[Attachment]:
    if not isinstance(sizes, list | tuple) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in sizes):
        raise ProtocolError('"buffers" must be a list of sizes in bytes', recoverable=True)
    if len(sizes) > MAX_ATTACHMENTS:
        raise ProtocolError(f"the line announces {len(sizes)} attachments, over the limit of {MAX_ATTACHMENTS}",
                            recoverable=True)
    if len(fds) != len(sizes):
        raise ProtocolError(f"the line announces {len(sizes)} attachment(s) but {len(fds)} descriptor(s) came "
                            "with it", recoverable=True)
    attachments = [Attachment(fd, size) for fd, size in zip(fds, sizes, strict=True)]
    for index, attachment in enumerate(attachments):
        _check_and_map(index, attachment, inbox)
    return attachments


def _check_and_map(index: int, attachment: Attachment, inbox: Inbox) -> None:
    fd, size, cap = attachment.fd, attachment.size, inbox.max_attachment_bytes
    if size > cap:
        raise ProtocolError(f"attachment {index} announces {size} bytes, over the cap of {cap} bytes "
                            "(RESIDENT_POOL_MAX_ATTACHMENT_BYTES)", recoverable=True)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ProtocolError(f"attachment {index} is not a memfd ({exc.strerror}); attachments must be sealed "
                            "memfds", recoverable=True) from None
    sealed = seals & _REQUIRED_SEALS == _REQUIRED_SEALS
    reused = not sealed and inbox.reused is not None and seals & _REUSED_SEALS == _REUSED_SEALS
    if not sealed and not reused:
        raise ProtocolError(f"attachment {index} is not sealed against writing, growing and shrinking (seals "
                            f"{seals:#x}); seal it with F_SEAL_WRITE|F_SEAL_GROW|F_SEAL_SHRINK before sending",
                            recoverable=True)
    info = os.fstat(fd)
    if info.st_size != size:
        raise ProtocolError(f"attachment {index} holds {info.st_size} bytes, not the {size} announced",
                            recoverable=True)
    if size == 0:
        return
    if reused:
        _map_reused(attachment, inbox, (info.st_dev, info.st_ino))
        return
    if size >= COPY_BELOW_BYTES and _MAPPINGS.live < _MAPPINGS.budget():
        try:
            attachment.buffer, attachment.address = _map_readonly(fd, size)
            return
        except OSError:
            pass  # out of mappings or address space: read a copy instead
    attachment.buffer = _read_copy(index, fd, size)


def _read_copy(index: int, fd: int, size: int) -> memoryview:
    copy = bytearray(size)
    view = memoryview(copy)
    done = 0
    while done < size:
        read = os.preadv(fd, [view[done:]], done)
        if read <= 0:
            raise ProtocolError(f"attachment {index} ended after {done} of {size} bytes", recoverable=True)
        done += read
    return view.toreadonly()


class _Mappings:
    """How many attachments this process holds mapped, against half of the kernel's vm.max_map_count.

    Counted without a lock (a mapping may be unmapped by the garbage collector in any thread): a
    miscount by a few leaves the margin to the kernel's limit all but whole.
    """

    def __init__(self) -> None:
        self.live = 0
        self._budget: int | None = None

    def budget(self) -> int:
        if self._budget is None:
            try:
                with open("/proc/sys/vm/max_map_count") as limit:
                    self._budget = int(limit.read()) // 2
            except (OSError, ValueError):
                self._budget = 65530 // 2  # the kernel's default
        return self._budget


_MAPPINGS = _Mappings()


class _Unmap:
    """Owned by a mapping's ctypes object: unmaps it once the last view of it is gone."""

    __slots__ = ("address", "mappings", "munmap", "size")

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        self.munmap = _libc().munmap  # held: module globals may be gone when the last view dies at exit
        self.mappings = _MAPPINGS
        self.mappings.live += 1

    def __del__(self) -> None:
        self.munmap(self.address, self.size)
        self.mappings.live -= 1


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC  # noqa: PLW0603 - loaded once, on the first attachment
    if _LIBC is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = libc
    return _LIBC


def _map_readonly(fd: int, size: int) -> tuple[memoryview, int]:
    """Map ``fd`` shared and read-only: a read-only byte view, and its address.

    Not mmap.mmap: before Python 3.13 it keeps a dup of the descriptor for the
    mapping's life, so a client holding 10,000 results would hold 10,000 fds.
    """
    import ctypes

    address = _mmap(fd, size, mmap.PROT_READ)
    region = (ctypes.c_ubyte * size).from_address(address)
    region._unmap = _Unmap(address, size)  # dies with the region, after every view of it
    return memoryview(region).cast("B").toreadonly(), address


def _map_reused(attachment: Attachment, inbox: Inbox, key: tuple[int, int]) -> None:
    """A reused buffer: this side's own one handed back (read in place: nobody else can change it), else the
    sender's, mapped once per connection and read in place (a worker) or only copied from (a client)."""
    attachment.reused = True
    own = inbox.slabs.view(key) if inbox.slabs is not None else None
    if own is not None:
        attachment.buffer, attachment.address = own
        return
    try:
        region, attachment.address = inbox.mappings.region(attachment.fd, attachment.size, key)
    except OSError:  # out of mappings or address space (or a memfd that will not map): read a copy instead
        attachment.buffer = _read_copy(0, attachment.fd, attachment.size)
        return
    attachment.watch = weakref.ref(region)
    attachment.buffer = memoryview(region).cast("B").toreadonly()
    attachment.copy = inbox.reused == COPY


class _MappingCache:
    """Read-only mappings of the reused buffers a peer sends, kept across its messages.

    Its buffers come back message after message (Slab), so each is mapped once per connection, not
    once per message: mapping 256 MiB and faulting it in cost 40 ms of a 50 ms read, measured here.
    Keyed by (device, inode): the mapping held here keeps the file, so no other file takes the inode.
    """

    LIMIT = 8  # a peer keeps a handful of buffers; past that, the least recently seen is unmapped

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[int, int], tuple[_Unmap, int, int]] = OrderedDict()

    def region(self, fd: int, size: int, key: tuple[int, int]) -> tuple[Any, int]:
        """A fresh object over the mapping (one per message: while it lives, something reads), and its address."""
        import ctypes

        entry = self.entries.get(key)
        if entry is None or entry[2] != size:
            address = _mmap(fd, size, mmap.PROT_READ)
            entry = self.entries[key] = (_Unmap(address, size), address, size)
            while len(self.entries) > self.LIMIT:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        unmap, address, _ = entry
        region = (ctypes.c_ubyte * size).from_address(address)
        region._unmap = unmap  # the mapping outlives the cache entry while this object lives
        return region, address

    def clear(self) -> None:
        self.entries.clear()


def _mmap(fd: int, size: int, prot: int) -> int:
    import ctypes

    address = _libc().mmap(None, size, prot, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return address


# -- reused buffers: made once, filled message after message -----------------------
# A fresh memfd's pages are allocated and zeroed as they are first touched: filling 256 MiB that way ran
# at about 1 GB/s here, against 16 GB/s for a copy into pages already there. A Slab is made once, its
# pages populated up front, and filled again for every message; a sealed memfd never can be (its seal
# is for good). MADV_POPULATE_WRITE (Linux 5.14; Python 3.11's mmap lacks the name) populates in one
# call; without it, one byte per page is touched. Huge pages where the host has some free (hugetlbfs).
MADV_POPULATE_WRITE = 23
_MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 0x0004)
_PAGE = mmap.PAGESIZE
# How the last Slab was made, for the bench and the worker's log: its pages and how they were populated.
SLAB_PATH = {"pages": None, "populate": None}


class Slab:
    """A reusable buffer: a memfd its owner mapped read-write, populated, then sealed F_SEAL_FUTURE_WRITE.

    Only that first mapping can ever write it: a receiver may map it read-only, never write it, grow
    it or shrink it (so a truncation cannot fault a reader). ``close()`` closes the descriptor; the
    mapping goes with the last object that holds ``unmap``.
    """

    __slots__ = ("__weakref__", "address", "fd", "key", "retired", "size", "unmap", "users")

    def __init__(self, fd: int, size: int, address: int) -> None:
        self.fd, self.size, self.address = fd, size, address
        info = os.fstat(fd)
        self.key = (info.st_dev, info.st_ino)
        self.unmap = _Unmap(address, size)
        self.users = 0  # owned by arrays.Slabs: uses in flight or lent out
        self.retired = False

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def make_slab(size: int, name: str = "resident-pool") -> Slab:
    """A new Slab of at least ``size`` bytes (a whole number of pages), its pages populated."""
    size = max(_PAGE, -(-size // _PAGE) * _PAGE)
    slab = _huge_slab(size, name)
    if slab is not None:
        return slab
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        address = _mmap(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            SLAB_PATH["populate"] = _populate(address, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REUSED_SEALS | fcntl.F_SEAL_SEAL)
        except BaseException:
            _libc().munmap(address, size)
            raise
    except BaseException:
        os.close(fd)
        raise
    SLAB_PATH["pages"] = f"{_PAGE // 1024} KiB ({_no_huge_pages()})"
    return Slab(fd, size, address)


def _populate(address: int, size: int) -> str:
    import ctypes

    libc = _libc()
    if libc.madvise(address, size, MADV_POPULATE_WRITE) == 0:
        return "MADV_POPULATE_WRITE"
    error = ctypes.get_errno()
    if error in (errno.ENOMEM, errno.EFAULT):
        # The memory is not there (a cgroup's limit), or touching it would raise SIGBUS: no buffer, and the message
        # goes in a fresh memfd as it would without one. A kernel that does not know the advice (before 5.14:
        # EINVAL) gets the pages touched one by one.
        raise OSError(error, f"populating a reused buffer of {size} bytes: {os.strerror(error)}")
    region = (ctypes.c_ubyte * size).from_address(address)
    memoryview(region).cast("B")[::_PAGE] = bytes(-(-size // _PAGE))  # an older kernel: touch each page
    return f"touched (madvise MADV_POPULATE_WRITE: {os.strerror(error)})"


def _meminfo() -> dict[str, int]:
    values = {}
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                name, _, rest = line.partition(":")
                if name in ("HugePages_Free", "Hugepagesize"):
                    values[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return values


def _no_huge_pages() -> str:
    return f"no huge pages free: HugePages_Free {_meminfo().get('HugePages_Free', 0)}"


def _huge_slab(size: int, name: str) -> Slab | None:
    """A Slab of huge pages (hugetlbfs) where the host has enough free, else None."""
    info = _meminfo()
    page = info.get("Hugepagesize", 0) * 1024
    if not page or size < page or info.get("HugePages_Free", 0) * page < size:
        return None
    size = -(-size // page) * page
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | _MFD_HUGETLB)
    except OSError:
        return None
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now: never a SIGBUS later
        address = _mmap(fd, size, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REUSED_SEALS | fcntl.F_SEAL_SEAL)
        except OSError:
            _libc().munmap(address, size)
            raise
    except OSError:
        os.close(fd)
        return None
    SLAB_PATH.update(pages=f"huge pages of {page // 1024} KiB (hugetlbfs)", populate="fallocate")
    return Slab(fd, size, address)


def recv_message(sock: socket.socket, inbox: Inbox, max_bytes: int = MAX_LINE_BYTES) -> Message | None:
    """recv_line with attachments: one message and the descriptors sent with it; None on a clean close."""
    scanned = 0
    while True:
        message = pop_message(inbox, max_bytes, scanned)
        if message is not None:
            return message
        scanned = len(inbox)
        if not fill(sock, inbox, min(RECV_CHUNK, max_bytes + 1 - len(inbox)) or 1):
            return closed(inbox)


def send_raw(sock: socket.socket, raw: bytes, fds: Sequence[int] = ()) -> None:
    """Send an encoded line, with ``fds`` passed beside its first byte."""
    try:
        if not fds:
            sock.sendall(raw)
            return
        sent = sock.sendmsg([raw], rights(fds))
        if sent < len(raw):
            sock.sendall(memoryview(raw)[sent:])
    except BlockingIOError:
        if _kernel_timeout(sock):
            raise TimeoutError("timed out") from None
        raise


def rights(fds: Sequence[int]) -> list[tuple[int, int, array.array]]:
    """The ancillary data that passes ``fds`` (SCM_RIGHTS) with a sendmsg."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]


def seal_memfd(parts: Sequence[tuple[int, Any]], size: int, name: str = "resident-pool") -> int:
    """A fresh memfd of ``size`` bytes holding each (offset, bytes-like) part, sealed; the caller closes it.

    Written with pwrite, not through a mapping: a shared writable mapping would
    have to be gone before F_SEAL_WRITE is accepted, and measured here pwrite
    was faster (1.4 GB/s against 0.8 for a copy into a populated mapping).
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for offset, part in parts:
            view = memoryview(part).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:done + _WRITE_CHUNK], offset + done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd
