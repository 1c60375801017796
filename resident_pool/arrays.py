"""Arrays in messages: numpy arrays and bytes travel beside the JSON line, as sealed memfds.

Standard library only, like protocol.py beside it: a worker loads this file by
path inside the model's own environment. numpy is used where it is importable;
without it an array arrives as an ``Array``.

In a line, an array is a reference: ``{"$buffer": 0, "dtype": "float32",
"shape": [1000, 1000], "offset": 0}`` names bytes in the message's attachment 0;
one under the threshold rides inline as ``{"$base64": "...", "dtype": ...,
"shape": [...]}``. ``bytes`` are dtype "bytes". A peer that did not say in its
ping that it takes attachments gets plain JSON instead: arrays as nested lists,
bytes as base64 text.

Between peers of version 2, attachments are reused buffers (``Slabs``): a
client session fills the same few pre-faulted buffers request after request,
and a worker builds its answers in buffers of its own (``worker_base.empty``).
A worker reads its client's buffers in place and says in each reply which it
still holds (``"held"``); a client copies out of a worker's buffers before
anything reads them. A sealed memfd per message remains for older peers.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import json
import math
import os
import struct
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DTYPES", "Array", "ArrayError", "Slabs", "answer", "complete", "decode", "encode", "exchange", "limits",
           "negotiate", "negotiated", "offer", "plain", "plain_line", "reuses", "stale", "with_field"]

# 2: reused buffers (Slabs) and the "held" field of a reply.
VERSION = 2
# Name -> itemsize. Native byte order (little-endian on every host the pool runs on).
DTYPES = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4, "int64": 8,
          "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16}
BYTES = "bytes"
MIN_BYTES_VARIABLE = "RESIDENT_POOL_ATTACH_MIN_BYTES"
MAX_BYTES_VARIABLE = "RESIDENT_POOL_MAX_ATTACHMENT_BYTES"
_ALIGN = 64  # each packed array starts on a cache line
_MAX_DIMS = 32
# memoryview.cast formats; float16 and the complex types are unpacked with struct.
_FORMATS = {"bool": "?", "int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
            "int64": "q", "uint64": "Q", "float32": "f", "float64": "d"}
_STRUCT = {"float16": "e", "complex64": "ff", "complex128": "dd"}


def _load_protocol():
    package = sys.modules.get(__package__) if __package__ else None
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    if any(os.path.realpath(folder) == here for folder in getattr(package, "__path__", ())):
        from . import protocol  # imported as part of its package, not loaded by path under another name

        return protocol
    module = sys.modules.get("resident_pool_protocol")  # worker_base loaded it first
    if module is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
        spec = importlib.util.spec_from_file_location("resident_pool_protocol", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["resident_pool_protocol"] = module
        spec.loader.exec_module(module)
    return module


protocol = _load_protocol()


class ArrayError(ValueError):
    """A reference in a message that names no array this message carries."""


def limits(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(attach_min_bytes, max_attachment_bytes) from the environment, or their defaults.

    For the worker, which has no settings module (the pool sets both variables for it); a client takes them from
    its ``Settings``.
    """
    environ = os.environ if environ is None else environ
    values = []
    for name, default in ((MIN_BYTES_VARIABLE, protocol.ATTACH_MIN_BYTES),
                          (MAX_BYTES_VARIABLE, protocol.MAX_ATTACHMENT_BYTES)):
        text = environ.get(name)
        try:
            value = default if text is None or not text.strip() else int(text)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name}={text!r} is not a size in bytes; unset it or give a whole number")
        values.append(value)
    return values[0], values[1]


_numpy_missing = False


def _numpy():
    """numpy if importable here (imported on first need), else None."""
    global _numpy_missing  # noqa: PLW0603 - one failed import is remembered, not retried per array
    module = sys.modules.get("numpy")
    if module is not None or _numpy_missing:
        return module
    try:
        import numpy
    except ImportError:
        _numpy_missing = True
        return None
    return numpy


class Array:
    """An array without numpy: C-order bytes in native byte order, a dtype name and a shape.

    What a receiver gets where numpy is not importable; ``numpy.asarray`` takes
    it without a copy. It pickles as its bytes.
    """

    __slots__ = ("_origin", "data", "dtype", "shape")

    def __init__(self, data: Any, dtype: str, shape: Any) -> None:
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        shape = tuple(int(n) for n in shape)
        view = memoryview(data).cast("B")
        if len(view) != DTYPES[dtype] * math.prod(shape):
            raise ValueError(f"{len(view)} bytes cannot hold a {dtype} array of shape {list(shape)}")
        self.data = view.toreadonly()
        self.dtype = dtype
        self.shape = shape
        self._origin: tuple[Any, int] | None = None  # (attachment, offset) it was read from

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def tolist(self) -> Any:
        """Nested lists of Python numbers, as numpy's ``tolist``."""
        if self.dtype in _FORMATS:
            flat = self.data.cast(_FORMATS[self.dtype]).tolist()
        else:
            code = _STRUCT[self.dtype]
            values = struct.iter_unpack(code, self.data)
            flat = [v[0] for v in values] if len(code) == 1 else [complex(*v) for v in values]
        return _nest(flat, self.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        numpy = sys.modules.get("numpy")  # whoever asks for __array__ imported it
        if numpy is None:
            raise TypeError("numpy is not imported here")
        array = numpy.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)
        return array if dtype is None else array.astype(dtype)

    def __reduce__(self):
        return (Array, (self.tobytes(), self.dtype, list(self.shape)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Array):
            return NotImplemented
        return (self.dtype, self.shape) == (other.dtype, other.shape) and self.data == other.data

    __hash__ = None  # type: ignore[assignment] # equal by content, and content is not hashed

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def rows(self, start: int, stop: int) -> Array:
        """Rows ``start`` to ``stop`` along the first axis (numpy's ``a[start:stop]``, clamped alike), sharing
        this array's bytes."""
        if not self.shape:
            raise IndexError("a 0-d array has no rows")
        start, stop, _ = slice(start, stop).indices(self.shape[0])
        stop = max(start, stop)
        row_bytes = DTYPES[self.dtype] * math.prod(self.shape[1:])
        return Array(self.data[start * row_bytes:stop * row_bytes], self.dtype, (stop - start, *self.shape[1:]))

    def __repr__(self) -> str:
        return f"Array(dtype={self.dtype!r}, shape={list(self.shape)}, nbytes={self.nbytes})"


# -- reused buffers ------------------------------------------------------------------
class _Use:
    """Rides on one view of a Slab: when the last view goes, so does this use of the buffer."""

    __slots__ = ("slab", "slabs")

    def __init__(self, slabs: Slabs, slab: Any) -> None:
        self.slabs, self.slab = slabs, slab

    def __del__(self) -> None:
        self.slabs._returned.append(self.slab)
        self.slabs._drain()


class Slabs:
    """A few reused buffers (protocol.Slab): a client session's, for its requests and for copies of its answers;
    or a worker connection's, for its replies.

    A buffer is taken for a message, sent (``sending``), and handed back (``settle``) once its reader
    said it has let go: only then is it filled again. One its reader still holds is retired, never
    written again. A buffer also counts as in use while a view of it is lent out (``lend``): an answer
    a caller keeps, an array a worker builds. Views die in any thread: what they give back is queued
    and taken in under a lock no finalizer ever waits for.
    """

    LIVE = 8  # buffers with a descriptor open at once; past it a message goes in a sealed memfd of its own
    FREE = 4  # kept for the next message
    FREE_BYTES = 2 << 30
    SMALLEST = 1 << 20  # sizes are powers of two from here: the next message of a similar size fits

    def __init__(self) -> None:
        self.free: list[Any] = []
        self.live: dict[tuple[int, int], Any] = {}
        self.pending: list[tuple[int, Any]] = []  # (attachment index, slab) of the message last sent
        self.used = False
        self.closed = False
        self._returned: deque[Any] = deque()
        self._lock = threading.Lock()

    # -- taking and giving back ----------------------------------------------------
    def take(self, nbytes: int, limit: int) -> Any:
        """A buffer of at least ``nbytes`` and at most ``limit`` bytes, in use until ``reserved``; None when
        ``LIVE`` are out or none can be made."""
        with self._lock:
            if self.closed:
                return None
            fits = [slab for slab in self.free if nbytes <= slab.size <= limit]
            if fits:
                slab = min(fits, key=lambda slab: slab.size)
                self.free.remove(slab)
            elif len(self.live) >= self.LIVE:
                return None
            else:
                # Rounded up (so the next message of a similar size fits) only where the buffer can then be kept
                # free; a bigger one is used once and retired, so it is the message's size (to a page): an array
                # of 2 GiB and a page never costs a second 2 GiB populated up front.
                rounded = max(self.SMALLEST, 1 << (nbytes - 1).bit_length())
                size = max(nbytes, min(limit, rounded) if rounded <= self.FREE_BYTES else nbytes)
                try:
                    slab = protocol.make_slab(size)
                except OSError:
                    return None
                if slab.size > limit:  # a whole number of (huge) pages past the receiver's cap
                    slab.close()
                    return None
                self.live[slab.key] = slab
            slab.users += 1
            self.used = True
        self._drain()
        return slab

    def size(self) -> int:
        """The bytes of the buffers open (free, in use or lent out)."""
        with self._lock:
            return sum(slab.size for slab in self.live.values())

    def reserved(self, slab: Any) -> None:
        """The use ``take`` began is over."""
        self._returned.append(slab)
        self._drain()

    def sending(self, sent: list[tuple[int, Any]]) -> None:
        """These buffers go with the message about to be sent (index -> slab); each is in use until ``settle``."""
        with self._lock:
            for _, slab in sent:
                slab.users += 1
            self.pending = sent

    def settle(self, held: Any = None) -> None:
        """The reader of the last message let go of its buffers, except the attachment indexes ``held``."""
        if not self.pending and not self._returned:  # nothing went with it (most messages carry no array)
            return
        # From the peer: anything but attachment numbers is no claim at all.
        held = {index for index in held if _int(index)} if isinstance(held, list) else set()
        with self._lock:
            pending, self.pending = self.pending, []
            for index, slab in pending:
                if index in held:
                    self._retire(slab)
        self._returned.extend(slab for _, slab in pending)
        self._drain()

    def lend(self, slab: Any, writable: bool = False) -> memoryview:
        """A view of the whole buffer; it stays in use while the view (or anything made from it) lives."""
        import ctypes

        region = (ctypes.c_ubyte * slab.size).from_address(slab.address)
        region._unmap = slab.unmap  # the mapping outlives the slab's descriptor while a view lives
        with self._lock:
            # A free buffer lent out (a reader handed back one it had let go) is in use until the view goes: off the
            # free list, or the next message would be written under the caller's answer.
            if slab in self.free:
                self.free.remove(slab)
            slab.users += 1
        region._use = _Use(self, slab)
        view = memoryview(region).cast("B")
        return view if writable else view.toreadonly()

    def view(self, key: tuple[int, int]) -> tuple[memoryview, int] | None:
        """A read-only view of this side's own buffer ``key`` (a reader handed it back), and its address."""
        slab = self.live.get(key)
        if slab is None or slab.retired:
            return None
        return self.lend(slab), slab.address

    def find(self, address: int, nbytes: int) -> tuple[Any, int] | None:
        """(slab, offset) when [address, address + nbytes) lies in one of these buffers."""
        for slab in list(self.live.values()):
            offset = address - slab.address
            if 0 <= offset <= slab.size - nbytes and not slab.retired:
                return slab, offset
        return None

    def copy_target(self, nbytes: int) -> memoryview | None:
        """A writable view of a free buffer to copy ``nbytes`` into (the copy of an answer); None if none is free."""
        if nbytes < protocol.COPY_BELOW_BYTES:
            return None  # small answers go in ordinary memory, as received ones under it do
        with self._lock:
            fits = [slab for slab in self.free if nbytes <= slab.size]
            if not fits:
                return None
            slab = min(fits, key=lambda slab: slab.size)
            self.free.remove(slab)
        return self.lend(slab, writable=True)  # in use while the answer's views live

    def fill(self, slab: Any, parts: Sequence[tuple[int, Any]]) -> None:
        """Copy each (offset, bytes-like) part into the buffer, through the owner's own mapping."""
        import ctypes

        region = (ctypes.c_ubyte * slab.size).from_address(slab.address)
        view = memoryview(region).cast("B")
        for offset, part in parts:
            data = memoryview(part).cast("B")
            view[offset:offset + len(data)] = data

    def close(self) -> None:
        """Close every descriptor; the views lent out keep their memory until they go."""
        with self._lock:
            self.closed = True
            for slab in self.live.values():
                slab.close()
            self.live.clear()
            self.free.clear()
            self.pending = []
        self._drain()

    # -- bookkeeping -------------------------------------------------------------------
    def _retire(self, slab: Any) -> None:
        slab.retired = True
        self.live.pop(slab.key, None)
        slab.close()

    def _drain(self) -> None:
        """Take in what views and settles gave back. Never waits for the lock: whoever holds it takes these in."""
        while self._returned and self._lock.acquire(blocking=False):
            try:
                while self._returned:
                    slab = self._returned.popleft()
                    slab.users -= 1
                    if slab.users == 0:
                        self._recycle(slab)
            finally:
                self._lock.release()

    def _recycle(self, slab: Any) -> None:
        free_bytes = sum(other.size for other in self.free)
        if slab.retired or self.closed or slab.fd < 0:
            return
        if len(self.free) >= self.FREE or free_bytes + slab.size > self.FREE_BYTES:
            self._retire(slab)
            return
        self.free.append(slab)


# -- sending ---------------------------------------------------------------------
class _Encoder:
    """json's ``default`` hook: each array or bytes becomes a reference (or plain JSON, for a peer without them)."""

    __slots__ = ("accept", "fds", "fresh_index", "fresh_size", "max_bytes", "min_bytes", "numpy", "parts", "passed",
                 "received", "sent", "sizes", "slabs", "torch")

    def __init__(self, peer: Mapping[str, Any] | None, min_bytes: int, received: list[Any],
                 slabs: Slabs | None = None) -> None:
        self.accept = bool(peer)
        self.max_bytes = int(peer.get("max_bytes", protocol.MAX_ATTACHMENT_BYTES)) if peer else 0
        self.min_bytes = min_bytes
        self.received = received
        self.slabs = slabs if slabs is not None and reuses(peer) else None
        self.sent: list[tuple[int, Any]] = []  # (index, slab) for each of this side's reused buffers it carries
        self.numpy = sys.modules.get("numpy")  # an ndarray can only exist if numpy was imported
        self.torch = sys.modules.get("torch")  # a tensor likewise
        self.sizes: list[int] = []  # per attachment
        self.fds: list[int] = []  # per attachment; -1 for the fresh memfd, made once the line is encoded
        self.passed: dict[int, int] = {}  # id(received attachment) -> its index here
        self.fresh_index: int | None = None
        self.parts: list[tuple[int, memoryview]] = []
        self.fresh_size = 0

    def default(self, value: Any) -> Any:
        numpy = self.numpy
        if self.torch is not None and isinstance(value, self.torch.Tensor):
            value = _tensor_array(value)
        if numpy is not None and isinstance(value, numpy.ndarray):
            if not self.accept:
                return value.tolist()
            native = self._native(value)
            return self._reference(native, memoryview(native.reshape(-1).view(self.numpy.uint8)), native.dtype.name,
                                   native.shape)
        if numpy is not None and isinstance(value, numpy.generic):
            return value.item()
        if isinstance(value, Array):
            return self._reference(value, value.data, value.dtype, value.shape) if self.accept else value.tolist()
        if isinstance(value, bytes | bytearray | memoryview):
            data = memoryview(value)
            data = data.cast("B") if data.c_contiguous else memoryview(data.tobytes())
            if not self.accept:
                return base64.b64encode(data).decode("ascii")
            return self._reference(value, data, BYTES, (len(data),))
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    def _native(self, value: Any) -> Any:
        """``value`` as what goes on the wire: C order, native byte order (a copy where it is not already)."""
        if value.dtype.name not in DTYPES:
            raise TypeError(f"a numpy array of dtype {value.dtype} cannot be sent; the protocol carries "
                            f"{', '.join(DTYPES)} (convert it, or send .tolist())")
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if not value.flags.c_contiguous:
            value = self.numpy.ascontiguousarray(value)
        return value

    def _reference(self, value: Any, data: memoryview, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
        nbytes = len(data)
        if nbytes < self.min_bytes:
            return {"$base64": base64.b64encode(data).decode("ascii"), "dtype": dtype, "shape": list(shape)}
        itemsize = 1 if dtype == BYTES else DTYPES[dtype]
        passed = self._passed_on(value, nbytes, itemsize) or self._in_slab(value, nbytes, itemsize)
        if passed is not None:
            index, offset = passed
            return {"$buffer": index, "dtype": dtype, "shape": list(shape), "offset": offset}
        offset = -(-self.fresh_size // _ALIGN) * _ALIGN
        if offset + nbytes > self.max_bytes:
            raise ValueError(f"the arrays of this message add up to {offset + nbytes} bytes, over the receiver's "
                             f"attachment cap of {self.max_bytes} bytes ({MAX_BYTES_VARIABLE}); "
                             "send them in several requests")
        if self.fresh_index is None:
            self.fresh_index = self._slot(-1, 0)
        self.parts.append((offset, data))
        self.fresh_size = offset + nbytes
        self.sizes[self.fresh_index] = self.fresh_size
        return {"$buffer": self.fresh_index, "dtype": dtype, "shape": list(shape), "offset": offset}

    def _slot(self, fd: int, size: int) -> int:
        if len(self.sizes) >= protocol.MAX_ATTACHMENTS:
            raise ValueError(f"a message carries at most {protocol.MAX_ATTACHMENTS} attachments")
        self.sizes.append(size)
        self.fds.append(fd)
        return len(self.sizes) - 1

    def _in_slab(self, value: Any, nbytes: int, itemsize: int) -> tuple[int, int] | None:
        """Where ``value`` lies wholly in one of this side's own reused buffers (built there by
        ``worker_base.empty``, or an answer a client hands back): that buffer goes, nothing is copied."""
        if self.slabs is None or self.numpy is None or not isinstance(value, self.numpy.ndarray):
            return None
        found = self.slabs.find(value.ctypes.data, nbytes)
        if found is None or found[1] % itemsize:
            return None
        slab, offset = found
        index = self.passed.get(id(slab))
        if index is None:
            index = self.passed[id(slab)] = self._slot(slab.fd, slab.size)
            self.sent.append((index, slab))
        return index, offset

    def _passed_on(self, value: Any, nbytes: int, itemsize: int) -> tuple[int, int] | None:
        """Where ``value`` lies wholly in a received (sealed, so unchanged) attachment: pass that one on.

        Only at an offset its dtype may start at (the receiver refuses others): a view that starts
        elsewhere, a packed format read from byte 1, goes in the fresh memfd instead.
        """
        if not self.received:
            return None
        if isinstance(value, Array):
            if value._origin is None:
                return None
            attachment, offset = value._origin
        elif self.numpy is not None and isinstance(value, self.numpy.ndarray) and value.flags.c_contiguous:
            owner = _owner(value)
            attachment = next((a for a in self.received if _owner(a.buffer) is owner and a.size), None)
            if attachment is None:
                return None
            if attachment.address is None:  # a copy read instead of a mapping
                attachment.address = self.numpy.frombuffer(attachment.buffer, self.numpy.uint8).ctypes.data
            offset = value.ctypes.data - attachment.address
        else:
            return None
        if attachment.fd < 0 or not 0 <= offset <= attachment.size - nbytes or offset % itemsize or not any(
                attachment is a for a in self.received):
            return None
        index = self.passed.get(id(attachment))
        if index is None:
            index = self.passed[id(attachment)] = self._slot(attachment.fd, attachment.size)
        return index, offset


def _nest(flat: list[Any], shape: tuple[int, ...]) -> Any:
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat  # already the list, not a copy of it
    return _rows(flat, shape, 0)


def _rows(flat: list[Any], dims: tuple[int, ...], start: int) -> list[Any]:
    # A module function, not a closure calling itself: that is a reference cycle holding ``flat``, freed only
    # when the cycle collector next runs (writing a 40 MB array a block at a time held some 300 MB of floats).
    if len(dims) == 1:
        return flat[start:start + dims[0]]
    step = math.prod(dims[1:])
    return [_rows(flat, dims[1:], start + i * step) for i in range(dims[0])]


def _tensor_array(tensor: Any) -> Any:
    """A torch CPU tensor as the numpy array over its memory (no copy); anything else is named."""
    if tensor.device.type != "cpu":
        raise TypeError(f"a torch tensor on {tensor.device} cannot be sent; send tensor.cpu() (or build it with "
                        "worker_base.empty) instead")
    try:
        return tensor.detach().numpy()
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"a torch tensor of dtype {tensor.dtype} cannot be sent ({exc}); the protocol carries "
                        f"{', '.join(DTYPES)}") from None


def _owner(value: Any) -> Any:
    """The object that owns ``value``'s memory: past numpy views and memoryviews."""
    while getattr(value, "base", None) is not None and not isinstance(value, memoryview):
        value = value.base
    return value.obj if isinstance(value, memoryview) else value


def encode(message: dict[str, Any], peer: Mapping[str, Any] | None, min_bytes: int = protocol.ATTACH_MIN_BYTES,
           received: Sequence[Any] = (), slabs: Slabs | None = None, *, try_plain: bool = True,
           ) -> tuple[bytes, list[int], int | None]:
    """The line for ``message``, the descriptors to send beside it, and the fresh memfd to close once sent.

    ``peer`` is what the other side said in its ping (falsy: plain JSON only).
    ``received`` are this request's attachments, which a reply may pass on.
    ``slabs``: this side's reused buffers; with a peer of version 2 the arrays go in one of them
    (``slabs.pending`` records which, for ``settle``) instead of a fresh memfd.
    A message without arrays encodes exactly as ``protocol.encode_line``.
    ``try_plain=False``: the caller found ``plain_line`` None already (it is not tried twice).
    """
    plain = plain_line(message) if try_plain else None
    if plain is not None:
        return plain, [], None
    encoder = _Encoder(peer, min_bytes, list(received), slabs)
    text = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=encoder.default)
    slab = None
    if encoder.fresh_index is not None and encoder.slabs is not None:
        slab = encoder.slabs.take(encoder.fresh_size, encoder.max_bytes)
        if slab is not None:  # the whole buffer is announced: the receiver checks its size
            encoder.sizes[encoder.fresh_index] = slab.size
            encoder.fds[encoder.fresh_index] = slab.fd
            encoder.sent.append((encoder.fresh_index, slab))
    try:
        if encoder.sizes:
            text = f'{text[:-1]}{"," if len(text) > 2 else ""}"buffers":{json.dumps(encoder.sizes)}}}'
        raw = text.encode("utf-8") + b"\n"
        if len(raw) > protocol.MAX_LINE_BYTES:
            raise ValueError(f"message is {len(raw)} bytes, over the protocol cap of {protocol.MAX_LINE_BYTES} "
                             "bytes; send large data as numpy arrays or bytes (they travel beside the line)")
        fresh = None
        if slab is not None:
            encoder.slabs.fill(slab, encoder.parts)
        elif encoder.fresh_index is not None:
            try:
                fresh = protocol.seal_memfd(encoder.parts, encoder.fresh_size)
            except OSError as exc:  # out of memory or descriptors: this message's failure, not the socket's
                raise ValueError(f"could not put {encoder.fresh_size} bytes of arrays in a memfd: {exc}") from exc
            encoder.fds[encoder.fresh_index] = fresh
        if encoder.sent:
            encoder.slabs.sending(encoder.sent)
    finally:
        if slab is not None:
            encoder.slabs.reserved(slab)  # the take's own use ends; the message's goes on until settled
    return raw, encoder.fds, fresh


class _NotPlain(Exception):
    """A value JSON does not carry as it is (an array, bytes): the message takes ``encode``'s whole path."""


def _not_plain(value: Any) -> Any:
    raise _NotPlain


# json's C encoder called directly, with encode's settings: json.dumps with keyword arguments builds a JSONEncoder on
# every call (about half of what encoding a short line costs here). Made per call with markers of its own: without
# them a cycle is followed until RecursionError, which under a raised recursion limit is past the C stack (a
# segfault); made once and shared, the markers a failed encode leaves would be another thread's too.
_MAKE_ENCODER = json.encoder.c_make_encoder


def plain_line(message: dict[str, Any]) -> bytes | None:
    """``message``'s line when it holds no array, bytes or anything else JSON does not carry as it is, and is under
    the cap; else None (``encode`` goes the whole way, and says what is wrong)."""
    if _MAKE_ENCODER is None:
        return None
    try:
        encoder = _MAKE_ENCODER({}, _not_plain, json.encoder.encode_basestring, None, ":", ",", False, False, False)
        raw = "".join(encoder(message, 0)).encode("utf-8") + b"\n"
    except Exception:  # noqa: BLE001 - whatever it is, the whole path meets it again and raises it as it always has
        return None
    return raw if len(raw) <= protocol.MAX_LINE_BYTES else None


def with_field(raw: bytes, name: str, value: Any) -> bytes:
    """An encoded line with one more top-level field (added after the line was encoded)."""
    return b"%s%s%s:%s}\n" % (raw[:-2], b"," if len(raw) > 3 else b"", json.dumps(name).encode(),
                               json.dumps(value, separators=(",", ":")).encode())


def plain(value: Any) -> Any:
    """A ``default`` for ``json.dumps``: arrays as nested lists, bytes as base64 text."""
    return _Encoder(None, 0, []).default(value)


# -- receiving -------------------------------------------------------------------
def decode(value: Any, attachments: list[Any], slabs: Slabs | None = None,
           max_copy_bytes: int = protocol.MAX_ATTACHMENT_BYTES) -> Any:
    """``value`` with each reference replaced by the array (or bytes) it names; read in place, never copied,
    except from a buffer its sender reuses (``Attachment.copy``): that is copied out first, at most
    ``max_copy_bytes`` per message, into one of ``slabs`` where one is free, else into new memory.

    Raises ArrayError for a reference that names no attachment of this message,
    an unknown dtype, bytes past the attachment's end, or copies past the cap.
    """
    reading = _Reading(attachments, _numpy(), slabs, max_copy_bytes)
    if _is_reference(value):
        return reading.build(value)
    stack = [value]
    while stack:  # iterative: a deep payload must not exhaust the stack
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, item in items:
            if _is_reference(item):
                node[key] = reading.build(item)
            elif isinstance(item, dict | list):
                stack.append(item)
    return value


class _Reading:
    """One message's references as they are read: its attachments, and what copying out has cost so far."""

    def __init__(self, attachments: list[Any], numpy: Any, slabs: Slabs | None, max_copy_bytes: int) -> None:
        self.attachments, self.numpy, self.slabs = attachments, numpy, slabs
        self.cap = self.copy_left = max_copy_bytes

    def build(self, reference: dict[str, Any]) -> Any:
        return _build(reference, self.attachments, self.numpy, self)

    def copied(self, source: memoryview, nbytes: int) -> memoryview:
        """``source``'s bytes copied into memory of this side's alone, read-only."""
        if nbytes > self.copy_left:
            raise ArrayError(f"the arrays this message names in buffers its sender reuses add up to more than "
                             f"{self.cap} bytes, the attachment cap ({MAX_BYTES_VARIABLE}); each is copied out "
                             "before it is read, so the cap bounds them together")
        self.copy_left -= nbytes
        target = self.slabs.copy_target(nbytes) if self.slabs is not None else None
        if target is None:
            target = memoryview(self.numpy.empty(nbytes, self.numpy.uint8) if self.numpy is not None
                                else bytearray(nbytes)).cast("B")
        target[:nbytes] = source
        return target[:nbytes].toreadonly()


def _shown_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."


def _is_reference(value: Any) -> bool:
    return isinstance(value, dict) and ("$buffer" in value or "$base64" in value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _build(reference: dict[str, Any], attachments: list[Any], numpy: Any, reading: _Reading | None = None) -> Any:
    """The array a reference names; every way a reference can be wrong is an ArrayError, never numpy's own."""
    try:
        return _read(reference, attachments, numpy, reading)
    except (ValueError, TypeError, OverflowError) as exc:  # past the checks in _read: still the peer's
        if isinstance(exc, ArrayError):
            raise
        raise ArrayError(f"array reference {_shown(reference)} cannot be read: {type(exc).__name__}: {exc}") from None


def _shown(reference: dict[str, Any]) -> str:
    text = repr({key: reference[key] for key in ("dtype", "shape", "offset", "$buffer") if key in reference})
    return text if len(text) <= 200 else text[:200] + "..."


def _read(reference: dict[str, Any], attachments: list[Any], numpy: Any, reading: _Reading | None = None) -> Any:
    dtype, shape = reference.get("dtype"), reference.get("shape")
    if not isinstance(dtype, str) or (dtype != BYTES and dtype not in DTYPES):
        raise ArrayError(f"array reference names dtype {_shown_value(dtype)}; the protocol carries "
                         f"{', '.join(DTYPES)}, bytes")
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
            _int(n) and 0 <= n <= sys.maxsize for n in shape):
        raise ArrayError(f"array reference has shape {_shown_value(shape)}; a shape is a list of at most "
                         f"{_MAX_DIMS} sizes")
    itemsize = 1 if dtype == BYTES else DTYPES[dtype]
    # numpy's own bound, zero dimensions left out: [0, 2**63] holds nothing, yet no array has that shape.
    if math.prod(n for n in shape if n) * itemsize > sys.maxsize:
        raise ArrayError(f"array reference has shape {_shown_value(shape)}: too large for any array")
    count = math.prod(shape)
    nbytes = count * itemsize
    attachment = None
    if "$buffer" in reference:
        index, offset = reference["$buffer"], reference.get("offset", 0)
        if not _int(index) or not 0 <= index < len(attachments):
            raise ArrayError(f"array reference names attachment {index!r}, but the message carried "
                             f"{len(attachments)}")
        attachment = attachments[index]
        if not _int(offset) or offset < 0 or offset % itemsize or offset + nbytes > attachment.size:
            raise ArrayError(f"array reference reads {nbytes} bytes at offset {offset!r} of attachment {index}, "
                             f"which holds {attachment.size}")
        buffer = attachment.buffer
        if attachment.copy:  # its sender may still change it: copy first, then read only the copy
            buffer = (reading or _Reading(attachments, numpy, None, protocol.MAX_ATTACHMENT_BYTES)).copied(
                buffer[offset:offset + nbytes], nbytes)
            attachment, offset = None, 0
    else:
        text = reference["$base64"]
        try:
            buffer = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except binascii.Error:
            buffer = None
        if buffer is None or len(buffer) != nbytes:
            raise ArrayError(f"inline array is not {nbytes} bytes of base64 for a {dtype} array of shape {shape}")
        offset = 0
    if dtype == BYTES:
        return bytes(memoryview(buffer)[offset:offset + nbytes])
    if numpy is not None:
        return numpy.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    array = Array(memoryview(buffer)[offset:offset + nbytes], dtype, shape)
    if attachment is not None:
        array._origin = (attachment, offset)
    return array


# -- the client's half of a request --------------------------------------------------
def negotiate(sock: Any, inbox: Any) -> None:
    """Ask the peer (a ping on this connection) whether it takes attachments; record its answer on ``inbox``.

    Tells the peer this side's cap (``inbox.max_attachment_bytes``), and version 2 (reused buffers) only
    for an inbox that says what to do with them (``protocol.COPY``).
    """
    protocol.send_line(sock, offer(inbox))
    negotiated(inbox, protocol.recv_message(sock, inbox))


def offer(inbox: Any) -> dict[str, Any]:
    """The ping that asks a peer about attachments (``negotiate``'s first half)."""
    version = VERSION if inbox.reused is not None else 1
    return {"op": "ping", "id": "attachments",
            "attachments": {"version": version, "max_bytes": inbox.max_attachment_bytes}}


def negotiated(inbox: Any, reply: Any) -> None:
    """Record the peer's answer to ``offer`` on ``inbox`` (``negotiate``'s second half)."""
    if reply is None:
        raise ConnectionResetError("the worker closed the connection before answering the attachments ping")
    reply.close()
    inbox.peer = accepted(reply.obj.get("attachments"))


def accepted(offer: Any) -> dict[str, Any]:
    """The peer's attachments offer if it is one this side speaks, else {} (plain JSON only)."""
    if isinstance(offer, dict) and _int(offer.get("version")) and offer["version"] >= 1 and _int(
            offer.get("max_bytes", 0)):
        return offer
    return {}


def reuses(peer: Mapping[str, Any] | None) -> bool:
    """Whether the peer takes reused buffers (it said version 2 or later)."""
    return bool(peer) and _int(peer.get("version")) and peer["version"] >= 2


def exchange(sock: Any, inbox: Any, message: dict[str, Any]) -> dict[str, Any] | None:
    """Send a request and return its reply, arrays in place; None when the peer closed instead.

    The first call on a connection negotiates (``negotiate``): arrays travel as
    attachments only to a worker that said it takes them.
    """
    if inbox.peer is None:
        negotiate(sock, inbox)
    return complete(sock, inbox, *encode(message, inbox.peer, inbox.attach_min_bytes, slabs=inbox.slabs))


class NotSent(OSError):
    """The request never reached its peer whole (the connection was gone before it was sent): it did not run."""


def unsent(exc: OSError) -> NotSent:
    """What a send that failed with ``exc`` means: the request did not run."""
    return NotSent(exc.errno, f"the request was not sent: {exc.strerror or exc}")


# Replies to earlier requests skipped in a row before the worker is taken for broken.
STALE_REPLIES = 16


def complete(sock: Any, inbox: Any, raw: bytes, fds: list[int], fresh: int | None,
             request_id: int | None = None) -> dict[str, Any] | None:
    """Send a request ``encode`` made (closing its fresh memfd) and return its reply, as ``exchange``.

    ``NotSent`` when the sending failed: a line cut short is never read as a request, so it did not run.
    ``request_id`` (ids rise on a connection): a reply to an earlier request, one no longer waited for (a worker
    that answered twice), is skipped, never taken for this one's.
    """
    try:
        protocol.send_raw(sock, raw, fds)
    except OSError as exc:
        raise unsent(exc) from exc
    finally:
        if fresh is not None:
            os.close(fresh)
    for _ in range(STALE_REPLIES + 1):
        reply = protocol.recv_message(sock, inbox)
        if reply is None or not stale(reply, request_id):
            return None if reply is None else answer(inbox, reply)
    raise too_many_stale()


def stale(reply: Any, request_id: int | None) -> bool:
    """Whether ``reply`` answers a request earlier than ``request_id`` (then it is closed, and skipped)."""
    answered = reply.obj.get("id")
    if request_id is None or not _int(answered) or answered >= request_id:
        return False
    reply.close()
    return True


def too_many_stale() -> Exception:
    return protocol.ProtocolError(f"the worker sent {STALE_REPLIES + 1} replies to earlier requests in a row")


def answer(inbox: Any, reply: Any) -> dict[str, Any]:
    """The reply's object, its arrays in place; the buffers the peer let go of are this side's again."""
    try:
        held = reply.obj.pop("held", None)
        if inbox.slabs is not None:  # before reading the reply: a buffer the worker let go may take a copy
            inbox.slabs.settle(held)
        if not reply.references:
            return reply.obj
        return decode(reply.obj, reply.attachments, inbox.slabs, inbox.max_attachment_bytes)
    except ArrayError as exc:
        raise protocol.ProtocolError(f"the reply's arrays cannot be read: {exc}", recoverable=True) from None
    finally:
        reply.close()
