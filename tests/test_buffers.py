"""Arrays beside the line: sealed memfds passed with SCM_RIGHTS, checked, mapped, matched to their line."""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import math
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import WORKERS, state_dir, wait_until
from hypothesis import given
from hypothesis import strategies as st
from providers import write_provider

from resident_pool import Pool, WorkerRequestError, arrays, protocol
from resident_pool.arrays import DTYPES, Array
from resident_pool.protocol import Inbox, ProtocolError, recv_message, send_line, send_raw
from resident_pool.providers.supervisor import PROTOCOL_PATH, WORKER_BASE_PATH

ARRAY_WORKER = WORKERS / "arrayworker.py"
PEER = {"version": arrays.VERSION, "max_bytes": protocol.MAX_ATTACHMENT_BYTES}
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


@pytest.fixture
def pair():
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield left, right
    left.close()
    right.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def random_array(dtype: str, shape, seed: int = 0):
    """Every bit pattern is fair game (NaN payloads, negative zero, subnormals): compare bytes, not values."""
    count = int(np.prod(shape))
    raw = np.random.default_rng(seed).integers(0, 256, count * DTYPES[dtype], dtype=np.uint8)
    if dtype == "bool":
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def send(sock, message, peer=PEER, received=()):
    raw, fds, fresh = arrays.encode(message, peer, received=received)
    try:
        send_raw(sock, raw, fds)
    finally:
        if fresh is not None:
            os.close(fresh)
    return raw, fds


def receive(sock, inbox=None):
    message = recv_message(sock, inbox if inbox is not None else Inbox())
    try:
        return arrays.decode(message.obj, message.attachments), message
    finally:
        message.close()


def memfd(data: bytes, seals: int = SEALS | fcntl.F_SEAL_SEAL) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def send_with_fds(sock, obj, fds):
    sock.sendmsg([protocol.encode_line(obj)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


# -- the wire, between two sockets -------------------------------------------------
@pytest.mark.parametrize("dtype", [*DTYPES, "bytes"])
@pytest.mark.parametrize("size", ["inline", "attached"])
def test_every_dtype_round_trips_bit_exact(pair, dtype, size):
    left, right = pair
    shape = (3, 5) if size == "inline" else (300, 257)  # 1-byte dtypes too are over 64 KiB
    value = random_array("uint8", (int(np.prod(shape)),)).tobytes() if dtype == "bytes" else \
        random_array(dtype, shape)
    _, fds = send(left, {"op": "predict", "payload": {"x": value, "zero_d": np.float64(-0.0)}})
    assert (len(fds) == 1) == (size == "attached")
    got, _ = receive(right)
    back = got["payload"]["x"]
    if dtype == "bytes":
        assert type(back) is bytes and back == value
    else:
        assert isinstance(back, np.ndarray) and back.dtype == value.dtype and back.shape == value.shape
        assert back.tobytes() == value.tobytes()
        assert not back.flags.writeable  # read in place from the sealed mapping
    assert json.dumps(got["payload"]["zero_d"]) == "-0.0"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_without_numpy_the_receiver_gets_an_array_object_that_round_trips_and_pickles(pair, dtype, monkeypatch):
    left, right = pair
    value = random_array(dtype, (130, 140), seed=1)
    send(left, {"op": "predict", "payload": value})
    monkeypatch.setattr(arrays, "_numpy", lambda: None)
    got, _ = receive(right)
    payload = got["payload"]
    assert isinstance(payload, Array) and payload.dtype == dtype and payload.shape == (130, 140)
    assert payload.tobytes() == value.tobytes()
    copy = pickle.loads(pickle.dumps(payload))
    assert copy == payload and copy.tobytes() == value.tobytes()
    if dtype not in ("float16", "float32", "float64", "complex64", "complex128"):  # NaN != NaN in lists
        assert payload.tolist() == value.tolist()
    assert np.asarray(payload).tobytes() == value.tobytes()


@given(shape=st.lists(st.integers(0, 4), max_size=4), dtype=st.sampled_from(list(DTYPES)), seed=st.integers(0, 99))
def test_array_tolist_matches_numpy_for_any_shape(shape, dtype, seed):
    value = random_array(dtype, shape, seed)
    if dtype.startswith(("float", "complex")):
        value = np.nan_to_num(value, nan=1.5, posinf=2.5, neginf=-2.5)  # NaN != NaN in lists
    assert Array(value.tobytes(), dtype, shape).tolist() == value.tolist()


@given(shape=st.lists(st.integers(0, 4), min_size=1, max_size=3), dtype=st.sampled_from(list(DTYPES)),
       start=st.integers(-5, 5), stop=st.integers(-5, 5))
def test_array_rows_match_numpys_slice_of_rows(shape, dtype, start, stop):
    value = np.nan_to_num(random_array(dtype, shape, 3), nan=1.5, posinf=2.5, neginf=-2.5)
    assert Array(value.tobytes(), dtype, shape).rows(start, stop).tolist() == value[start:stop].tolist()


def test_received_numpy_arrays_pickle_by_value(pair):
    left, right = pair
    value = random_array("float32", (512, 512))
    send(left, {"op": "predict", "payload": value})
    got, _ = receive(right)
    copy = pickle.loads(pickle.dumps(got["payload"]))
    assert copy.tobytes() == value.tobytes() and copy.flags.writeable


def test_received_arrays_hold_no_descriptor_while_they_live(pair):
    """A campaign may keep thousands of results: each must cost a mapping, not an open fd."""
    left, right = pair
    value = random_array("float32", (200, 200))
    before = open_fds()
    held = []
    for _ in range(300):
        send(left, {"op": "predict", "payload": value})
        held.append(receive(right)[0]["payload"])
    assert open_fds() == before
    assert all(item.tobytes() == value.tobytes() for item in held)


def test_descriptors_are_matched_to_their_own_line_when_one_read_brings_several(pair):
    left, right = pair
    first, second = random_array("int32", (300, 100), 1), random_array("int32", (300, 100), 2)
    # Four lines in a row before the reader reads: plain, attached, plain, attached.
    send_line(left, {"n": 1})
    send(left, {"n": 2, "x": first})
    send_line(left, {"n": 3})
    send(left, {"n": 4, "x": second})
    inbox = Inbox()
    seen = []
    for _ in range(4):
        message = recv_message(right, inbox)
        got = arrays.decode(message.obj, message.attachments)
        seen.append((got["n"], len(message.attachments), got.get("x")))
        message.close()
    assert [(n, count) for n, count, _ in seen] == [(1, 0), (2, 1), (3, 0), (4, 1)]
    assert seen[1][2].tobytes() == first.tobytes() and seen[3][2].tobytes() == second.tobytes()
    assert not inbox.fds


def test_descriptors_sent_with_a_line_that_does_not_announce_them_are_refused_and_closed(pair):
    left, right = pair
    before = open_fds()
    fd = memfd(b"x" * 64)
    send_with_fds(left, {"op": "predict", "payload": 1}, [fd])
    os.close(fd)
    send_line(left, {"op": "ping"})
    inbox = Inbox()
    with pytest.raises(ProtocolError, match="announces 0 attachment") as info:
        recv_message(right, inbox)
    assert info.value.recoverable
    assert recv_message(right, inbox).obj == {"op": "ping"}  # the stream is still framed
    assert open_fds() == before


def _case(kind):
    """(descriptor, announced size) for each thing a hostile or buggy sender could pass."""
    if kind == "wrong size":
        return memfd(b"x" * 100), 200
    if kind == "unsealed memfd":
        return memfd(b"x" * 100, seals=0), 100
    if kind == "writable memfd":
        return memfd(b"x" * 100, seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK), 100
    if kind == "shrinkable memfd":
        return memfd(b"x" * 100, seals=fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW), 100
    if kind == "pipe":
        read, write = os.pipe()
        os.close(write)
        return read, 100
    if kind == "regular file":
        path = state_dir() / "plain-file"
        path.write_bytes(b"x" * 100)
        return os.open(path, os.O_RDONLY), 100
    raise AssertionError(kind)


REFUSALS = {"wrong size": "holds 100 bytes, not the 200 announced", "unsealed memfd": "not sealed",
            "writable memfd": "not sealed", "shrinkable memfd": "not sealed", "pipe": "not a memfd",
            "regular file": "not a memfd"}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_descriptor_that_is_not_a_sealed_memfd_of_the_announced_size_is_refused(pair, kind):
    left, right = pair
    before = open_fds()
    fd, size = _case(kind)
    send_with_fds(left, {"op": "predict", "buffers": [size],
                         "payload": {"$buffer": 0, "dtype": "uint8", "shape": [size]}}, [fd])
    os.close(fd)
    send_line(left, {"op": "ping"})
    inbox = Inbox()
    with pytest.raises(ProtocolError, match=REFUSALS[kind]) as info:
        recv_message(right, inbox)
    assert info.value.recoverable
    assert recv_message(right, inbox).obj == {"op": "ping"}
    assert open_fds() == before  # the refused descriptor was closed, once


def test_an_attachment_over_a_lowered_cap_is_refused_before_mapping(pair):
    left, right = pair
    value = random_array("uint8", (100_000,))
    send(left, {"op": "predict", "payload": value})
    with pytest.raises(ProtocolError, match=r"over the cap of 1000 bytes.*RESIDENT_POOL_MAX_ATTACHMENT_BYTES"):
        recv_message(right, Inbox(max_attachment_bytes=1000))


def test_a_sender_checks_the_receivers_cap_first():
    with pytest.raises(ValueError, match="over the receiver's attachment cap of 1000 bytes"):
        arrays.encode({"op": "predict", "payload": np.zeros(100_000, np.uint8)}, {"version": 1, "max_bytes": 1000})


@pytest.mark.parametrize(
    ("reference", "buffers", "expected"),
    [({"$buffer": 0, "dtype": "float32", "shape": [4]}, [], "names attachment 0, but the message carried 0"),
     ({"$buffer": 3, "dtype": "float32", "shape": [4]}, [16], "names attachment 3, but the message carried 1"),
     ({"$buffer": 0, "dtype": "float32", "shape": [8]}, [16], "which holds 16"),
     ({"$buffer": 0, "dtype": "float32", "shape": [2], "offset": 12}, [16], "at offset 12"),
     ({"$buffer": 0, "dtype": "object", "shape": [1]}, [16], "names dtype 'object'"),
     ({"$buffer": 0, "dtype": "uint8", "shape": [-1]}, [16], "shape"),
     ({"$base64": "AAAA", "dtype": "float64", "shape": [1]}, [], "not 8 bytes of base64")],
)
def test_references_that_name_what_the_message_does_not_carry_are_refused(pair, reference, buffers, expected):
    left, right = pair
    fds = [memfd(b"\0" * size) for size in buffers]
    send_with_fds(left, {"op": "predict", "payload": {"x": [reference]}, "buffers": buffers}, fds) if fds else \
        send_line(left, {"op": "predict", "payload": {"x": [reference]}})
    for fd in fds:
        os.close(fd)
    message = recv_message(right, Inbox())
    with pytest.raises(arrays.ArrayError, match=expected):
        arrays.decode(message.obj, message.attachments)
    message.close()


def memfd_maps() -> int:
    """This process's memory maps of memfds (each mapped attachment is one)."""
    with open("/proc/self/maps") as maps:
        return sum("/memfd:" in line for line in maps)


def test_received_attachments_under_a_mib_are_read_into_memory_not_mapped(pair):
    """Each mapping takes one of the process's vm.max_map_count maps while its array lives: holding thousands of
    results must not take thousands of them."""
    left, right = pair
    value = random_array("float32", (128, 128))  # 64 KiB: an attachment at the default threshold
    inbox, held, before = Inbox(), [], memfd_maps()
    for i in range(2000):
        send(left, {"i": i, "x": value})
        got, message = receive(right, inbox)
        held.append(got["x"])
        assert message.attachments  # it did travel as an attachment
    assert memfd_maps() - before < 10
    assert all(not x.flags.writeable for x in held) and held[-1].tobytes() == value.tobytes()
    big = random_array("uint8", (protocol.COPY_BELOW_BYTES,))
    send(left, {"x": big})
    got, _ = receive(right, inbox)
    assert memfd_maps() == before + 1 and got["x"].tobytes() == big.tobytes()  # a large one is mapped in place


def test_past_half_the_map_limit_every_attachment_is_copied_with_a_budget_lowered_to_50(pair, monkeypatch):
    left, right = pair
    monkeypatch.setattr(protocol._MAPPINGS, "_budget", protocol._MAPPINGS.live + 50)
    value = random_array("uint8", (protocol.COPY_BELOW_BYTES,))
    inbox, held, before = Inbox(), [], memfd_maps()
    for _ in range(80):
        send(left, {"x": value})
        held.append(receive(right, inbox)[0]["x"])
    assert memfd_maps() - before == 50 and all(x.tobytes() == value.tobytes() for x in held[::10])
    del held
    assert memfd_maps() == before  # each unmapped with its array


HOLDER = """
import os, socket, threading, numpy as np
from resident_pool import arrays, protocol
left, right = socket.socketpair()
peer = {"version": 1, "max_bytes": 1 << 32}
value = np.ones(1024, dtype=np.float32)  # 4 KiB, over the lowered threshold: an attachment
N = 70000  # past vm.max_map_count's default of 65530
def sender():
    for i in range(N):
        raw, fds, fresh = arrays.encode({"i": i, "x": value}, peer, min_bytes=4096)
        protocol.send_raw(left, raw, fds)
        os.close(fresh)
threading.Thread(target=sender, daemon=True).start()
inbox, held = protocol.Inbox(), []
try:
    for i in range(N):
        message = protocol.recv_message(right, inbox)
        held.append(arrays.decode(message.obj, message.attachments)["x"])
        message.close()
    np.zeros(16 << 20, np.float32)  # an ordinary 64 MiB allocation after
    started = threading.Thread(target=lambda: None)  # and a thread's stack (it printed a newline into the line below)
    started.start()
    started.join()
    print("held", len(held), float(sum(x[0] for x in held[::1000])))
except MemoryError:
    print(f"MemoryError after {len(held)} results held")
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_holding_70000_received_arrays_leaves_the_process_able_to_allocate():
    """The end-to-end case: results of 4 KiB (the attachment threshold lowered to 4 KiB) held past the kernel's
    default count of memory maps."""
    done = subprocess.run([sys.executable, "-c", HOLDER], capture_output=True, text=True, timeout=280, check=False)
    assert "held 70000 70.0" in done.stdout, done.stdout + done.stderr[-2000:]


def test_small_payloads_stay_pure_json_lines(pair):
    left, right = pair
    plain = {"op": "predict", "id": 7, "payload": {"inputs": ["MKV", "GGA"], "n": 2.5}}
    raw, fds, fresh = arrays.encode(plain, PEER)
    assert raw == protocol.encode_line(plain) and fds == [] and fresh is None
    small = np.arange(10, dtype=np.float32)  # far under the threshold: inline, no descriptor
    raw, fds = send(left, {"op": "predict", "payload": small})
    assert fds == [] and b'"$base64"' in raw and b'"buffers"' not in raw
    got, message = receive(right)
    assert message.attachments == [] and got["payload"].tobytes() == small.tobytes()


def test_a_message_the_plain_encoder_cannot_take_whole_goes_the_whole_way_and_fails_as_it_always_did(monkeypatch):
    # encode tries one cached C encoder first (no arrays, no markers); anything else is encoded again on the whole
    # path: its arrays travel, and its mistakes raise the errors they raised before the fast path.
    circular: dict = {}
    circular["self"] = circular
    cases = [({"x": math.nan}, ValueError, "Out of range float"), ({"x": {1, 2}}, TypeError, "set is not JSON"),
             ({(1, 2): 0}, TypeError, "keys must be"), (circular, ValueError, "Circular reference")]
    for message, error, words in cases:
        with pytest.raises(error, match=words):
            arrays.encode(message, PEER)
    raw = arrays.encode({"a": [{"b": np.float32(1.5)}], "c": b"\x01"}, PEER)[0]
    assert json.loads(raw)["a"] == [{"b": 1.5}] and json.loads(raw)["c"]["dtype"] == "bytes"
    monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 100)
    with pytest.raises(ValueError, match="over the protocol cap"):
        arrays.encode({"x": "y" * 200}, PEER)


def test_a_peer_that_did_not_ask_for_attachments_gets_lists_and_base64():
    raw, fds, _ = arrays.encode({"ok": True, "result": {"x": np.arange(3, dtype=np.int16), "b": b"\x00\xff"}}, {})
    assert fds == [] and json.loads(raw) == {"ok": True, "result": {"x": [0, 1, 2], "b": "AP8="}}


def test_unsupported_dtypes_are_named():
    with pytest.raises(TypeError, match="dtype <U3 cannot be sent"):
        arrays.encode({"ok": True, "result": np.array(["abc"])}, PEER)


# -- a real worker -------------------------------------------------------------------
@pytest.fixture
def array_worker(request):
    """The array test worker started by hand (``python -S``: no numpy in its environment, when asked)."""
    flags = getattr(request, "param", [])
    socket_path = str(state_dir() / "arrays.sock")
    env = {**os.environ, "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH}
    with subprocess.Popen([sys.executable, *flags, str(ARRAY_WORKER), socket_path], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        wait_until(lambda: answers(socket_path) or proc.poll() is not None, message="the worker to answer")
        assert proc.poll() is None, proc.stderr.read().decode()
        yield socket_path, proc
        proc.kill()


def answers(socket_path):
    """The path exists from bind(), a moment before listen(): only a ping answered says it serves."""
    try:
        with protocol.connect(socket_path) as conn:
            send_line(conn, {"op": "ping", "id": 0})
            return protocol.recv_line(conn, bytearray())["ok"]
    except (FileNotFoundError, ConnectionRefusedError):
        return False


def test_hostile_json_naming_an_unsent_buffer_gets_an_error_reply(array_worker):
    socket_path, proc = array_worker
    with protocol.connect(socket_path) as conn:
        inbox = Inbox()
        arrays.negotiate(conn, inbox)
        for hostile in ({"$buffer": 0, "dtype": "float32", "shape": [1000]},
                        {"$buffer": 5, "dtype": "float32", "shape": [1], "offset": 0}):
            send_line(conn, {"op": "predict", "id": 1, "payload": {"value": hostile}})
            reply = recv_message(conn, inbox).obj
            assert reply["ok"] is False and reply["reason"] == "bad_request"
            assert "names attachment" in reply["error"] and "carried 0" in reply["error"]
        fd = memfd(b"x" * 100, seals=0)  # and an unsealed descriptor, announced as the payload
        send_with_fds(conn, {"op": "predict", "id": 2, "buffers": [100],
                             "payload": {"value": {"$buffer": 0, "dtype": "uint8", "shape": [100]}}}, [fd])
        os.close(fd)
        reply = recv_message(conn, inbox).obj
        assert reply["reason"] == "bad_request" and "not sealed" in reply["error"]
        assert arrays.exchange(conn, inbox, {"op": "predict", "id": 3, "payload": {"value": 5}})["result"]["value"] == 5
    assert proc.poll() is None


HOSTILE_REFERENCES = {
    # Zero elements but a dimension numpy cannot hold: plain JSON, no descriptor needed.
    "a 2**63 dimension": {"$base64": "", "dtype": "float32", "shape": [0, 2**63]},
    "dimensions too big together": {"$base64": "", "dtype": "float32", "shape": [0, 2**62, 4]},
    "a list as dtype": {"$base64": "", "dtype": [], "shape": [0]},
    "a dict as dtype": {"$base64": "", "dtype": {"a": 1}, "shape": [0]},
    "a float as offset": {"$buffer": 0, "dtype": "uint8", "shape": [0], "offset": 0.5},
    "a list as attachment": {"$buffer": [], "dtype": "uint8", "shape": [0]},
    "a bool in the shape": {"$base64": "", "dtype": "uint8", "shape": [True, 0]},
    "a number as base64": {"$base64": 5, "dtype": "uint8", "shape": [0]},
}


@pytest.mark.parametrize("array_worker", [[], ["-S"]], indirect=True, ids=["numpy worker", "no numpy in the worker"])
@pytest.mark.parametrize("name", list(HOSTILE_REFERENCES))
def test_one_hostile_array_reference_gets_a_bad_request_reply_and_the_worker_stays_up(array_worker, name):
    socket_path, proc = array_worker
    with protocol.connect(socket_path) as conn:
        conn.settimeout(30)
        inbox = Inbox()
        send_line(conn, {"op": "predict", "id": 1, "payload": {"value": HOSTILE_REFERENCES[name]}})
        reply = recv_message(conn, inbox).obj
        assert reply["ok"] is False and reply["reason"] == "bad_request", reply
        assert "array reference" in reply["error"] or "inline array" in reply["error"], reply
        assert arrays.exchange(conn, inbox, {"op": "predict", "id": 2, "payload": {"value": 5}})["result"]["value"] == 5
    assert proc.poll() is None


@pytest.mark.parametrize("name", list(HOSTILE_REFERENCES))
def test_decode_raises_only_array_error_for_a_hostile_reference(name, monkeypatch):
    for numpy_here in (True, False):
        if not numpy_here:
            monkeypatch.setattr(arrays, "_numpy", lambda: None)
        with pytest.raises(arrays.ArrayError):
            arrays.decode({"value": json.loads(json.dumps(HOSTILE_REFERENCES[name]))}, [])


def test_through_the_pool_one_hostile_json_payload_leaves_the_warm_worker_serving(pool_dir):
    array_provider(pool_dir)
    with Pool() as pool, pool.session("arrays") as session:
        assert session.predict({"value": 5})["value"] == 5
        with pytest.raises(WorkerRequestError) as raised:
            session.predict({"value": HOSTILE_REFERENCES["a 2**63 dimension"]})
        assert raised.value.reason == "bad_request", str(raised.value)
        assert session.predict({"value": 6})["value"] == 6  # the same session, the same worker
        assert os.path.exists(f"/proc/{session.pid}")


def test_an_echo_passes_on_the_descriptor_it_received(array_worker):
    socket_path, _ = array_worker
    value = random_array("float32", (256, 256))
    with protocol.connect(socket_path) as conn:
        inbox = Inbox()
        arrays.negotiate(conn, inbox)
        raw, fds, fresh = arrays.encode({"op": "predict", "id": 1, "payload": {"value": value}}, inbox.peer)
        sent = os.fstat(fresh).st_ino
        send_raw(conn, raw, fds)
        os.close(fresh)
        reply = recv_message(conn, inbox)
        assert [os.fstat(a.fd).st_ino for a in reply.attachments] == [sent]  # the same memfd came back
        result = arrays.decode(reply.obj, reply.attachments)["result"]
        reply.close()
    assert result["value"].tobytes() == value.tobytes()


@pytest.mark.parametrize("how", ["byteswapped", "big-endian copy", "misaligned"])
def test_a_view_of_a_received_array_arrives_with_the_values_the_worker_meant(array_worker, how):
    """A worker hands back a view of what it received: the caller gets its values (a byte-order view is
    converted, a view at an offset its dtype cannot start at is copied), never the received bytes as they were
    and never a refusal."""
    socket_path, proc = array_worker
    value = np.arange(1, 32769, dtype=np.int32)  # 128 KiB: an attachment, which the worker could pass on
    if how == "misaligned":
        value = (np.arange(200_001) % 251).astype(np.uint8)
    with protocol.connect(socket_path) as conn:
        reply = arrays.exchange(conn, Inbox(), {"op": "predict", "id": 1,
                                                "payload": {"action": "view", "how": how, "value": value}})
    result = reply["result"]
    got = result["value"]
    assert got[:4].tolist() == result["first"], (how, got[:4])
    assert float(got.astype("float64").sum()) == result["sum"]
    assert proc.poll() is None


@pytest.mark.parametrize("array_worker", [["-S"]], indirect=True, ids=["no numpy in the worker"])
def test_a_worker_without_numpy_gets_array_objects_and_returns_them(array_worker):
    socket_path, _ = array_worker
    value = random_array("float64", (300, 70))
    with protocol.connect(socket_path) as conn:
        inbox = Inbox()
        seen = arrays.exchange(conn, inbox, {"op": "predict", "id": 1,
                                             "payload": {"action": "describe", "value": value}})["result"]
        assert seen == {"type": "Array", "numpy": False, "sha256": hashlib.sha256(value.tobytes()).hexdigest()}
        echoed = arrays.exchange(conn, inbox, {"op": "predict", "id": 2, "payload": {"value": value}})["result"]
        made = arrays.exchange(conn, inbox, {"op": "predict", "id": 3, "payload": {
            "action": "make", "dtype": "int16", "shape": [400, 200], "nbytes": 160_000, "hex": "0102"}})["result"]
    assert echoed["value"].tobytes() == value.tobytes()
    assert made["value"].dtype == np.int16 and made["value"].shape == (400, 200)
    assert made["value"].tobytes() == b"\x01\x02" * 80_000


def test_a_client_that_did_not_negotiate_gets_plain_json(array_worker):
    socket_path, _ = array_worker
    with protocol.connect(socket_path) as conn:
        send_line(conn, {"op": "predict", "id": 1, "payload": {
            "action": "make", "dtype": "uint8", "shape": [100_000], "nbytes": 100_000, "hex": "07"}})
        reply = protocol.recv_line(conn, bytearray())
    assert reply["result"]["value"] == [7] * 100_000


def test_a_worker_that_cannot_find_arrays_py_speaks_plain_json(tmp_path):
    """A container that binds only protocol.py and worker_base.py: the worker must still start and answer."""
    import shutil

    for name in (PROTOCOL_PATH, WORKER_BASE_PATH):
        shutil.copy(name, tmp_path)
    socket_path = str(state_dir() / "plain.sock")
    env = {**os.environ, "RESIDENT_POOL_PROTOCOL": str(tmp_path / "protocol.py"),
           "RESIDENT_POOL_WORKER_BASE": str(tmp_path / "worker_base.py")}
    value = random_array("int16", (300, 300))
    with subprocess.Popen([sys.executable, str(WORKERS / "testworker.py"), socket_path], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        try:
            wait_until(lambda: answers(socket_path) or proc.poll() is not None, message="the worker to answer")
            with protocol.connect(socket_path) as conn:
                inbox = Inbox()
                reply = arrays.exchange(conn, inbox, {"op": "predict", "id": 1,
                                                      "payload": {"action": "echo", "value": value}})
        finally:
            proc.kill()
        log = proc.stderr.read().decode()
    assert inbox.peer == {} and reply["result"]["echo"] == value.tolist()
    assert "arrays.py is not beside protocol.py" in log


class OldWorker(threading.Thread):
    """A worker from before attachments: JSON lines only, a ping without an offer; records what it got."""

    def __init__(self, path):
        super().__init__(daemon=True)
        self.listener = protocol.bind_unix(path)
        self.lines: list[bytes] = []
        self.descriptors = 0

    def run(self):
        conn, _ = self.listener.accept()
        with conn:
            buf = bytearray()
            while True:
                data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
                self.descriptors += len(ancillary)
                if not data:
                    return
                buf += data
                while (message := protocol.pop_line(buf)) is not None:
                    self.lines.append(protocol.encode_line(message))
                    answer = {"model": "old"} if message["op"] == "ping" else {"result": message.get("payload")}
                    send_line(conn, {"ok": True, "id": message.get("id"), **answer})


def test_an_old_worker_gets_plain_json_and_keeps_working():
    path = str(state_dir() / "old.sock")
    old = OldWorker(path)
    old.start()
    value = random_array("int32", (200, 200))
    with protocol.connect(path) as conn:
        inbox = Inbox()
        result = arrays.exchange(conn, inbox, {"op": "predict", "id": 1, "payload": {"x": value}})["result"]
        small = {"op": "predict", "id": 2, "payload": {"inputs": ["MKV"]}}
        assert arrays.exchange(conn, inbox, small)["result"] == {"inputs": ["MKV"]}
    old.join(timeout=10)
    old.listener.close()
    assert inbox.peer == {} and old.descriptors == 0
    assert result == {"x": value.tolist()}
    assert old.lines[-1] == protocol.encode_line(small)  # a plain request is byte for byte what it always was


# -- through the pool ------------------------------------------------------------------
def array_provider(manifests):
    write_provider(manifests, "arrays", 'worker_args = ["{socket}"]\n',
                   worker="arrayworker.py")


def worker_fds(pid):
    """The worker's open fds once it has closed the last request's descriptors (just after it replied)."""

    def memfds():
        links = []
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
            except FileNotFoundError:
                pass
        return links, [link for link in links if link.startswith("/memfd:")]

    wait_until(lambda: not memfds()[1], message="the worker to close the last request's descriptors")
    return len(memfds()[0])


@pytest.mark.slow
def test_no_descriptor_leaks_over_10000_requests_with_attachments(pool_dir, reliability_row):
    array_provider(pool_dir)
    value = random_array("float32", (128, 256))  # 128 KiB: over the threshold, so an attachment each way
    with Pool() as pool, pool.session("arrays") as session:
        # The session keeps a few reused buffers: one lent to the answer held, one for the next request.
        echoed = session.predict({"value": value})
        echoed = session.predict({"value": value})
        client_before, worker_before = open_fds(), worker_fds(session.pid)
        for i in range(10_000):
            echoed = session.predict({"value": value, "i": i})
            assert echoed["value"].shape == (128, 256)
        client_after, worker_after = open_fds(), worker_fds(session.pid)
        assert echoed["value"].tobytes() == value.tobytes()
    reliability_row("10,000 requests with attachments", "every array back, bit-exact",
                    leaked=(client_after - client_before) + (worker_after - worker_before))
    assert (client_after, worker_after) == (client_before, worker_before)


def test_a_worker_that_dies_holding_a_mapped_buffer_loses_nothing_of_the_callers(pool_dir):
    array_provider(pool_dir)
    sent = random_array("float64", (500, 500))
    kept = sent.copy()
    with Pool() as pool:
        with pool.session("arrays") as session:
            made = session.predict({"action": "make", "dtype": "uint8", "shape": [1 << 20], "nbytes": 1 << 20,
                                    "hex": "abcd"})["value"]
        with pool.session("arrays") as session, pytest.raises(WorkerRequestError) as info:
            session.predict({"action": "die", "value": sent})
        assert info.value.reason == "worker_died"
        wait_until(lambda: not os.path.exists(f"/proc/{session.pid}"), message="the worker to be gone")
        # The caller's own array is untouched, and a result mapped from the dead worker's memfd still reads.
        assert sent.tobytes() == kept.tobytes()
        assert made.tobytes() == b"\xab\xcd" * (1 << 19)
        again = pool.predict("arrays", {"value": sent})  # a fresh worker takes the same array
    assert again["value"].tobytes() == kept.tobytes()


def test_a_payload_that_cannot_be_sent_is_the_callers_error_and_the_session_goes_on(pool_dir):
    """Refused before a byte is sent (a dtype the protocol does not carry, an array over the worker's cap):
    the caller gets the error, the session and its worker stay as they were."""
    array_provider(pool_dir)
    with Pool() as pool, pool.session("arrays") as session:
        pid = session.pid
        with pytest.raises(TypeError, match="dtype <U4 cannot be sent"):
            session.predict({"value": np.array(["text"])})
        with pytest.raises(ValueError, match=r"NaN|Out of range float"):
            session.predict({"value": float("nan")})
        assert session.predict({"value": 1})["value"] == 1
        assert session.pid == pid
        leased = {w["pid"]: w["state"] for w in pool.status()["workers"]}
    assert leased.get(pid) == "leased", leased  # still ours: not abandoned, not drained


@pytest.mark.slow
def test_minilm_returns_its_embeddings_as_one_array_when_asked(pool_dir):
    import shutil

    shutil.copytree(Path(__file__).resolve().parents[1] / "manifests" / "minilm", pool_dir / "minilm")
    texts = [f"MKVLAAGIVGLLLA{'G' * i}" for i in range(50)]  # 50 x 384 float32: over the threshold, attached
    with Pool() as pool, pool.session("minilm") as session:
        answer = session.predict({"inputs": texts, "encoding": "array"})
        reference = session.predict({"inputs": texts, "digits": 8})
    embeddings = answer["embeddings"]
    assert isinstance(embeddings, np.ndarray) and embeddings.dtype == np.float32 and embeddings.shape == (50, 384)
    assert [item["tokens"] for item in answer["items"]] == [item["tokens"] for item in reference["items"]]
    expected = np.array([item["embedding"] for item in reference["items"]], dtype=np.float32)
    assert np.abs(embeddings - expected).max() < 1e-6


def test_the_cli_prints_arrays_in_a_result_as_lists(pool_dir):
    array_provider(pool_dir)
    payload = {"action": "make", "dtype": "uint16", "shape": [2, 40_000], "nbytes": 160_000, "hex": "0300"}
    done = subprocess.run([sys.executable, "-m", "resident_pool", "predict", "arrays", "--payload", json.dumps(payload)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads(done.stdout)["value"] == [[3] * 40_000] * 2


def worker_memfds(pid):
    names = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith("/memfd:"):
                names.append(name)
        except FileNotFoundError:
            pass
    return names


def test_a_client_that_dies_mid_line_leaves_the_worker_no_descriptor(array_worker):
    socket_path, proc = array_worker
    conn = protocol.connect(socket_path)
    fds = [memfd(b"x" * 4096) for _ in range(3)]
    # Half a line with three descriptors beside it, then the client is gone.
    conn.sendmsg([b'{"op": "predict", "buffers": [4096, 4096, 4096], "payload": '],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    for fd in fds:
        os.close(fd)
    wait_until(lambda: len(worker_memfds(proc.pid)) == 3, message="the worker to hold the three descriptors")
    conn.close()
    wait_until(lambda: not worker_memfds(proc.pid), message="the worker to close them")
    assert answers(socket_path)


def test_a_flood_of_descriptors_without_a_line_closes_that_connection_only(array_worker):
    socket_path, proc = array_worker
    conn = protocol.connect(socket_path)
    fd = memfd(b"x" * 64)
    try:
        for _ in range(300):  # one descriptor a byte, never a newline: past what a message may carry
            conn.sendmsg([b" "], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker hung up: what this test wants
    finally:
        os.close(fd)
    try:  # the reply, unless the hang-up with our bytes unread reset the stream first (Linux does that)
        reply = recv_message(conn, Inbox())
        assert reply.obj["reason"] == "bad_request"
        assert "more descriptors than a message may carry" in reply.obj["error"]
        assert recv_message(conn, Inbox()) is None
    except ConnectionResetError:
        pass
    conn.close()
    wait_until(lambda: not worker_memfds(proc.pid), message="the worker to close every descriptor it was sent")
    assert answers(socket_path) and proc.poll() is None


# -- reused buffers (version 2): a session's few pre-faulted memfds, filled request after request ------------------
PEER_2 = {"version": 2, "max_bytes": protocol.MAX_ATTACHMENT_BYTES}


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def test_a_held_session_sends_arrays_without_faulting_their_pages_in_again(pool_dir):
    """20 requests of a 16 MiB array, each read whole by the worker: after the first, the worker faults in none of
    its pages again (a fresh memfd per message faulted in every page of every message)."""
    array_provider(pool_dir)
    value = random_array("uint8", (16 << 20,))
    digest = hashlib.sha256(value).hexdigest()
    with Pool() as pool, pool.session("arrays") as session:
        for _ in range(2):
            session.predict({"action": "describe", "value": value})
        before = minor_faults(session.pid)
        for _ in range(20):
            assert session.predict({"action": "describe", "value": value})["sha256"] == digest
        faults = minor_faults(session.pid) - before
    assert faults < (16 << 20) // mmap.PAGESIZE // 4, faults  # a quarter of one message's pages, for 20 messages


def test_a_buffer_the_worker_still_holds_is_never_filled_again(pool_dir):
    """The worker keeps a received array past its request: the session's next requests go in other buffers, and
    what the worker kept still reads as it was sent."""
    array_provider(pool_dir)
    first, second = random_array("uint8", (2 << 20,), 1), random_array("uint8", (2 << 20,), 2)
    with Pool() as pool, pool.session("arrays") as session:
        kept = session.predict({"action": "keep", "value": first})["sha256"]
        for _ in range(3):
            session.predict({"action": "describe", "value": second})
        assert session.predict({"action": "kept"})["sha256"] == kept == hashlib.sha256(first).hexdigest()


def _sent_in_a_slab(left, value, slabs=None):
    slabs = slabs or arrays.Slabs()
    raw, fds, fresh = arrays.encode({"x": value}, PEER_2, slabs=slabs)
    assert fresh is None and len(fds) == 1 and fds[0] == slabs.pending[0][1].fd  # a reused buffer, not a fresh memfd
    send_raw(left, raw, fds)
    return slabs


def test_a_reused_buffer_cannot_be_changed_by_its_reader(pair):
    left, right = pair
    value = random_array("uint8", (1 << 20,))
    slabs = _sent_in_a_slab(left, value)
    message = recv_message(right, Inbox(reused=protocol.IN_PLACE))
    fd = message.attachments[0].fd
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        mmap.mmap(fd, 1 << 20, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # another open file, the same seals
    try:
        with pytest.raises(PermissionError):
            os.pwrite(reopened, b"x", 0)
    finally:
        os.close(reopened)
    got = arrays.decode(message.obj, message.attachments)["x"]
    message.close()
    assert got.tobytes() == value.tobytes() and not got.flags.writeable
    slabs.close()


def test_a_receiver_that_did_not_ask_for_reused_buffers_refuses_them(pair):
    left, right = pair
    _sent_in_a_slab(left, random_array("uint8", (1 << 20,))).close()
    with pytest.raises(ProtocolError, match="not sealed against writing"):
        recv_message(right, Inbox())


def test_a_reused_buffer_that_could_shrink_is_refused(pair):
    """A truncated mapping faults its reader (SIGBUS): a reused buffer must be sealed against shrinking."""
    left, right = pair
    fd = memfd(b"x" * 4096, seals=protocol.F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_GROW)
    send_with_fds(left, {"buffers": [4096], "x": {"$buffer": 0, "dtype": "uint8", "shape": [4096]}}, [fd])
    os.close(fd)
    with pytest.raises(ProtocolError, match="not sealed"):
        recv_message(right, Inbox(reused=protocol.COPY))


def test_a_client_copies_a_workers_reused_buffer_before_reading_it(pair):
    """The sender writes its buffer again after sending it: what the receiver decoded stays as it was sent."""
    left, right = pair
    value = random_array("uint8", (2 << 20,))
    slabs = _sent_in_a_slab(left, value)
    inbox = Inbox(reused=protocol.COPY)
    message = recv_message(right, inbox)
    got = arrays.decode(message.obj, message.attachments, max_copy_bytes=inbox.max_attachment_bytes)["x"]
    message.close()
    slab = slabs.pending[0][1]
    slabs.fill(slab, [(0, bytes(slab.size))])  # the sender's own mapping still writes it
    assert got.tobytes() == value.tobytes()
    slabs.close()


def test_copies_out_of_reused_buffers_are_bounded_by_the_cap_per_message(pair):
    """Three references of 600 kB into one 1 MiB reused buffer, under a cap of 1 MiB: copying them all would take
    1.8 MB; refused before the third copy."""
    left, right = pair
    slabs = arrays.Slabs()
    slab = slabs.take(1 << 20, 1 << 20)
    refs = [{"$buffer": 0, "dtype": "uint8", "shape": [600_000], "offset": 0} for _ in range(3)]
    send_with_fds(left, {"buffers": [slab.size], "x": refs}, [slab.fd])
    inbox = Inbox(max_attachment_bytes=1 << 20, reused=protocol.COPY)
    message = recv_message(right, inbox)
    with pytest.raises(arrays.ArrayError, match="add up to more than 1048576 bytes"):
        arrays.decode(message.obj, message.attachments, max_copy_bytes=inbox.max_attachment_bytes)
    message.close()
    slabs.close()


def test_an_array_built_in_a_reused_buffer_is_sent_without_a_copy(pair, monkeypatch):
    left, right = pair
    slabs = arrays.Slabs()
    slab = slabs.take(1 << 20, protocol.MAX_ATTACHMENT_BYTES)
    built = np.frombuffer(slabs.lend(slab, writable=True), np.float32).reshape(512, 512)
    slabs.reserved(slab)
    built[:] = 7.5

    def no_copy(*_):
        raise AssertionError("the array was copied")

    monkeypatch.setattr(arrays.Slabs, "fill", no_copy)
    raw, fds, fresh = arrays.encode({"x": built[256:]}, PEER_2, slabs=slabs)
    assert fds == [slab.fd] and fresh is None
    send_raw(left, raw, fds)
    got, _ = receive(right, Inbox(reused=protocol.COPY))
    assert got["x"].shape == (256, 512) and (got["x"] == 7.5).all()
    slabs.close()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_worker_builds_its_answer_where_the_reply_goes(pool_dir, kind):
    array_provider(pool_dir)
    with Pool() as pool, pool.session("arrays") as session:
        for fill in (3, 4):
            got = session.predict({"action": "build", "shape": [1024, 1024], "dtype": "int16", "fill": fill,
                                   "torch": kind == "torch"})
            assert got["type"] == kind
            assert got["value"].dtype == np.int16 and got["value"].shape == (1024, 1024) and (got["value"] == fill).all()
        small = session.predict({"action": "build", "shape": [4], "dtype": "int16", "fill": 5, "torch": kind == "torch"})
        assert small["value"].tolist() == [5] * 4  # under the threshold: ordinary memory, inline


def test_a_worker_that_keeps_changing_its_answer_cannot_change_what_the_client_got(pool_dir):
    array_provider(pool_dir)
    with Pool() as pool, pool.session("arrays") as session:
        got = session.predict({"action": "scribble", "shape": [4 << 20], "for_s": 1.0})["value"]
        seen = got.tobytes()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the worker writes its buffer all the while
            assert got.tobytes() == seen
        assert session.predict({"action": "describe", "value": b"ok"})["sha256"]  # and it still serves


def test_past_the_live_buffers_a_session_sends_sealed_memfds_and_every_answer_stays_right(pool_dir):
    """Each echoed answer holds the buffer its request went in; holding 12 of them takes the session past its 8 reused
    buffers: the rest go in sealed memfds of their own, and the client's descriptors stay bounded."""
    array_provider(pool_dir)
    values = [random_array("uint8", (1 << 20,), seed) for seed in range(12)]
    with Pool() as pool, pool.session("arrays") as session:
        session.predict({"value": values[0]})
        before = open_fds()
        held = [session.predict({"value": value})["value"] for value in values]
        assert open_fds() - before <= arrays.Slabs.LIVE
        assert [x.tobytes() for x in held] == [v.tobytes() for v in values]


KILLED_CLIENT = """
import sys, numpy as np
from resident_pool import Pool
with Pool() as pool, pool.session("arrays") as session:
    print("sending", flush=True)
    session.predict({"action": "slow", "sleep_s": 3, "value": np.ones(4 << 20, np.uint8)})
"""


def test_a_client_killed_while_the_worker_reads_its_buffer_costs_the_worker_nothing(pool_dir):
    array_provider(pool_dir)
    with Pool() as pool:
        pid = pool.predict("arrays", {"value": 1})["pid"]
        with subprocess.Popen([sys.executable, "-c", KILLED_CLIENT], stdout=subprocess.PIPE, text=True) as client:
            assert client.stdout.readline().strip() == "sending"
            wait_until(lambda: any(w["state"] == "leased" for w in pool.status()["workers"]),
                       message="the client's lease")
            wait_until(lambda: _reads_a_memfd(pid), message="the worker to map the client's buffer")
            client.kill()
        value = random_array("uint8", (2 << 20,))
        assert pool.predict("arrays", {"value": value})["value"].tobytes() == value.tobytes()
        assert pool.predict("arrays", {"value": 1})["pid"] == pid  # the same worker, still up


def _reads_a_memfd(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return any("/memfd:" in line for line in maps)


def test_without_madvise_populate_a_buffer_is_made_by_touching_its_pages(monkeypatch):
    libc = protocol._libc()

    class NoPopulate:
        def __getattr__(self, name):
            return getattr(libc, name)

        @staticmethod
        def madvise(*_):
            return -1

    monkeypatch.setattr(protocol, "_LIBC", NoPopulate())
    slab = protocol.make_slab(3 << 20)
    try:
        assert protocol.SLAB_PATH["populate"].startswith("touched") and slab.size == 3 << 20
        assert protocol.SLAB_PATH["pages"].startswith("4 KiB")
    finally:
        slab.close()


def test_a_host_that_claims_huge_pages_it_cannot_give_gets_ordinary_ones(monkeypatch):
    monkeypatch.setattr(protocol, "_meminfo", lambda: {"Hugepagesize": 2048, "HugePages_Free": 1 << 20})
    slab = protocol.make_slab(4 << 20)
    try:
        assert slab.size == 4 << 20 and protocol.SLAB_PATH["pages"].startswith("4 KiB")
    finally:
        slab.close()


def test_a_reply_that_claims_to_hold_nonsense_claims_nothing_and_the_buffer_is_reused(pair):
    left, right = pair
    inbox = Inbox(reused=protocol.COPY)
    inbox.peer, inbox.slabs = PEER_2, arrays.Slabs()
    encoded = arrays.encode({"x": random_array("uint8", (1 << 20,))}, PEER_2, slabs=inbox.slabs)

    def worker():
        recv_message(right, Inbox(reused=protocol.IN_PLACE)).close()
        send_line(right, {"ok": True, "held": [{"a": 1}, "0", None, True, 2**70, [0]]})

    thread = threading.Thread(target=worker)
    thread.start()
    assert arrays.complete(left, inbox, *encoded) == {"ok": True}
    thread.join()
    assert len(inbox.slabs.free) == 1 and len(inbox.slabs.live) == 1  # let go of, and kept for the next message
    inbox.close()



class _NoMemory:
    """libc as the protocol uses it, but madvise(MADV_POPULATE_WRITE) fails with ``error``."""

    def __init__(self, libc, error):
        self.libc, self.error = libc, error

    def __getattr__(self, name):
        return getattr(self.libc, name)

    def madvise(self, address, size, advice):
        import ctypes

        ctypes.set_errno(self.error)
        return -1


@pytest.mark.parametrize("error", ["ENOMEM", "EFAULT"])
def test_a_buffer_whose_pages_cannot_be_populated_is_not_made_and_the_message_goes_fresh(monkeypatch, pair, error):
    """MADV_POPULATE_WRITE failing for want of memory (ENOMEM), or where touching would raise SIGBUS (EFAULT),
    means no reused buffer: the message goes in a fresh sealed memfd. Touching every page instead (the path for a
    kernel that does not know the advice) committed the memory anyway, or killed the process."""
    import errno as codes

    monkeypatch.setattr(protocol, "_LIBC", _NoMemory(protocol._libc(), getattr(codes, error)))
    monkeypatch.setattr(protocol, "_huge_slab", lambda size, name: None)
    fds = open_fds()
    with pytest.raises(OSError) as raised:
        protocol.make_slab(4 << 20)
    assert raised.value.errno == getattr(codes, error) and "populating" in str(raised.value)
    assert open_fds() == fds, "make_slab left a descriptor open"
    slabs = arrays.Slabs()
    assert slabs.take(4 << 20, protocol.MAX_ATTACHMENT_BYTES) is None and not slabs.live
    # A session's message all the same: the array goes, in a fresh sealed memfd.
    left, right = pair
    x = np.arange(1 << 20, dtype=np.float32)
    raw, sent, fresh = arrays.encode({"x": x}, PEER, slabs=slabs)
    assert fresh is not None and not slabs.pending
    send_raw(left, raw, sent)
    os.close(fresh)
    got, _ = receive(right)
    assert np.array_equal(got["x"], x)
    slabs.close()


def _buffer_maps(pid="self"):
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[4] for line in maps if "memfd:resident-pool" in line}  # by inode


def test_pool_predict_keeps_small_buffers_between_calls_and_gives_big_ones_back_on_both_sides(pool_dir):
    """A kept lease keeps at most KEPT_BUFFER_BYTES of reused buffers between calls: 1 MiB arrays sent call after
    call go in the same buffer, never a new one; after a call with 32 MiB each way neither the client nor the
    worker maps any of that call's buffers (the worker's own answer buffers included) once it has returned."""
    from resident_pool.client import KEPT_BUFFER_BYTES

    array_provider(pool_dir)
    small = random_array("uint8", (1 << 20,))
    with Pool() as pool:
        before = _buffer_maps()
        seen = set()
        for _ in range(5):
            assert pool.predict("arrays", {"action": "describe", "value": small})["sha256"]
            seen |= _buffer_maps() - before
        assert len(seen) == 1, f"1 MiB arrays went in {len(seen)} buffers, not one kept between calls"
        big = random_array("uint8", (32 << 20,))
        assert KEPT_BUFFER_BYTES < 32 << 20
        answer = pool.predict("arrays", {"action": "make", "hex": "ab", "nbytes": 32 << 20, "dtype": "uint8",
                                         "shape": [32 << 20], "ignored": big})
        assert answer["value"].nbytes == 32 << 20
        worker = answer["pid"]
        del answer, big
        assert not _buffer_maps() - before, "the client still maps a buffer of the big call"
        wait_until(lambda: not _buffer_maps(worker), timeout=10,
                   message=f"the worker to let go of its buffers: {_buffer_maps(worker)}")
        assert pool.predict("arrays", {"action": "describe", "value": small})["sha256"]  # and the lease goes on


def test_a_buffer_the_worker_let_go_and_then_hands_back_is_not_filled_again_under_the_callers_answer(pair):
    """Issue 31, finding 3: a worker answered "held": [] for the client's buffer, then named the same buffer in a
    later reply: it was lent to the caller as that answer while it stayed on the session's free list, and the next
    request filled it: the caller's read-only array changed from ones to sevens after predict had returned."""
    left, right = pair
    ones = np.ones(1 << 18, np.float32)  # 1 MiB: a reused buffer
    slabs = _sent_in_a_slab(left, ones)
    client = Inbox(reused=protocol.COPY)
    client.slabs = slabs
    sent = recv_message(right, Inbox(reused=protocol.IN_PLACE))
    kept = os.dup(sent.attachments[0].fd)  # the worker keeps the client's buffer past its request
    sent.close()
    send_line(right, {"ok": True, "id": 1, "held": []})  # ... and says it let go of it
    first = recv_message(left, client)
    slabs.settle(first.obj.pop("held"))
    first.close()
    send_with_fds(right, {"ok": True, "id": 2, "buffers": [ones.nbytes],
                          "result": {"$buffer": 0, "dtype": "float32", "shape": [ones.size]}}, [kept])
    os.close(kept)
    second = recv_message(left, client)
    answer = arrays.decode(second.obj, second.attachments, slabs)["result"]
    second.close()
    assert answer.tolist()[:4] == [1.0, 1.0, 1.0, 1.0]
    raw, fds, _ = arrays.encode({"x": np.full(1 << 18, 7, np.float32)}, PEER_2, slabs=slabs)  # the next request
    send_raw(left, raw, fds)
    assert answer.tolist()[:4] == [1.0, 1.0, 1.0, 1.0], "the caller's answer was filled by the next request"
    recv_message(right, Inbox(reused=protocol.IN_PLACE)).close()
    del answer
    slabs.close()
    client.close()


@pytest.mark.parametrize(("buffers", "match"), [([64], "announces 1 attachment"), (5, "must be a list"),
                                                ([], None)])
def test_a_line_that_announces_buffers_is_checked_even_with_no_descriptor_beside_it(pair, buffers, match):
    """Lines with neither descriptors nor "buffers" skip the attachment checks (most calls); one that announces
    buffers is checked all the same."""
    left, right = pair
    send_line(left, {"op": "predict", "payload": 1, "buffers": buffers})
    send_line(left, {"op": "ping"})
    inbox = Inbox()
    if match is None:
        assert recv_message(right, inbox).attachments == []
    else:
        with pytest.raises(ProtocolError, match=match) as info:
            recv_message(right, inbox)
        assert info.value.recoverable
    assert recv_message(right, inbox).obj == {"op": "ping"}
