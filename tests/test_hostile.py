"""Hostile and malformed input: fuzzed protocol lines, fuzzed manifests, unsendable results, forbidden calls."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import LONG_LIVED, TEST_WORKER, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from providers import write_provider

from resident_pool import ManifestError, protocol
from resident_pool.protocol import ProtocolError, pop_line, recv_line, send_line
from resident_pool.providers.manifest import load_manifest
from resident_pool.providers.supervisor import PROTOCOL_PATH, WORKER_BASE_PATH

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.reliability

INPUT_CLASSES = [
    ("protocol reader: random bytes, truncated, nested, huge numbers, bad UTF-8, over cap (300 cases)",
     "ProtocolError or a message; never more than the cap held"),
    ("worker fed the same junk (60 cases)", "error replies or a closed stream; next request answered"),
    ("mutated and random manifests (250 cases)", "ManifestError naming the file, nothing else"),
    ("NaN, over-the-cap and unsendable results", "WorkerRequestError naming why; worker stays up"),
    ("pickle / shell=True / os.system in the package and flows", "none found"),
]


@pytest.fixture(scope="module", autouse=True)
def record_input_classes(request):
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before:
        from conftest import RELIABILITY_ROWS

        RELIABILITY_ROWS.extend({"fault": name, "seen": seen, "lost": 0, "leaked": 0} for name, seen in INPUT_CLASSES)
CAP = 4096

lines = st.one_of(
    st.binary(max_size=600),
    st.binary(max_size=200).map(lambda b: b + b"\n"),
    st.integers(min_value=1, max_value=3000).map(lambda depth: b"[" * depth + b"]" * depth + b"\n"),
    st.integers(min_value=1, max_value=2000).map(lambda digits: b'{"n": ' + b"9" * digits + b"}\n"),
    st.just(b"\xff\xfe\xfd{}\n"),
    st.integers(min_value=CAP, max_value=CAP * 3).map(lambda size: b"x" * size + b"\n"),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
                 max_leaves=20).map(lambda obj: __import__("json").dumps(obj).encode() + b"\n"),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(lines, max_size=6))
def test_the_reader_never_crashes_and_never_holds_more_than_the_cap(chunks):
    buf = bytearray(b"".join(chunks))
    for _ in range(len(chunks) + 2):
        try:
            message = pop_line(buf, max_bytes=CAP)
        except ProtocolError as exc:
            if not exc.recoverable:
                assert buf == b""  # an unframeable stream is dropped, not buffered
                break
            continue
        if message is None:
            break
        assert isinstance(message, dict)
    assert len(buf) <= CAP


@pytest.fixture(scope="module")
def live_worker(tmp_path_factory):
    """One raw test worker for the fuzzing below (hypothesis runs many examples against it)."""
    directory = tmp_path_factory.mktemp("fuzz")
    socket_path = str(directory / "w.sock")
    env = {**os.environ, "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH}
    with subprocess.Popen([sys.executable, str(TEST_WORKER), socket_path], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL) as proc:
        wait_until(lambda: os.path.exists(socket_path), message="the worker's socket")
        LONG_LIVED.add(proc.pid)  # it outlives each example by design; the leak check still sees all else
        try:
            yield socket_path, proc
        finally:
            proc.kill()
            LONG_LIVED.discard(proc.pid)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# A well-formed shutdown is no junk: the live worker would stop (hypothesis once drew {"op": "shutdown"}).
@given(junk=st.lists(lines.filter(lambda line: b"shutdown" not in line), min_size=1, max_size=4))
def test_a_worker_fed_junk_answers_the_next_well_formed_request(live_worker, junk):
    socket_path, proc = live_worker
    with protocol.connect(socket_path) as conn:
        conn.settimeout(10)
        try:
            conn.sendall(b"".join(junk))
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(65536):
                pass  # read the error replies until the worker closes
        except OSError:
            pass  # it may close the stream mid-way: a line over the cap
    with protocol.connect(socket_path) as conn:
        conn.settimeout(10)
        send_line(conn, {"op": "predict", "id": 1, "payload": {"action": "echo", "value": "still here"}})
        assert recv_line(conn, bytearray())["result"]["echo"] == "still here"
    assert proc.poll() is None


VALID = (ROOT / "manifests" / "minilm" / "manifest.toml").read_text()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_manifests_fail_only_with_a_manifest_error_naming_the_file(tmp_path, data):
    text = VALID
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        position = data.draw(st.integers(min_value=0, max_value=len(text)))
        mutation = data.draw(st.sampled_from(["delete", "insert", "replace"]))
        junk = data.draw(st.text(alphabet='[]="{}.,#\n \\abc019-_', max_size=6))
        if mutation == "delete":
            text = text[:position] + text[position + len(junk) + 1:]
        elif mutation == "insert":
            text = text[:position] + junk + text[position:]
        else:
            text = text[:position] + junk + text[position + len(junk):]
    folder = tmp_path / "minilm"
    folder.mkdir(exist_ok=True)
    (folder / "worker.py").write_text("")
    path = folder / "manifest.toml"
    path.write_text(text)
    try:
        load_manifest(path)
    except ManifestError as exc:
        assert str(path) in str(exc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.dictionaries(st.sampled_from(["slug", "worker", "mode", "gpu", "env", "kit", "weights", "x"]),
                                st.one_of(st.integers(), st.text(max_size=5), st.dictionaries(st.text(max_size=4),
                                                                                              st.integers(), max_size=3)),
                                max_size=6))
def test_random_documents_fail_only_with_a_manifest_error(tmp_path, document):
    path = write_provider(tmp_path, "fuzzed", "")
    path.write_text("\n".join(f"{key} = {_toml(value)}" for key, value in document.items()))
    try:
        load_manifest(path)
    except ManifestError as exc:
        assert str(path) in str(exc)


def _toml(value):
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {v}' for k, v in value.items()) + "}"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def test_huge_and_unsendable_results_are_named_errors_and_the_worker_stays_up(workers):
    from helpers import worker_command

    from resident_pool import WorkerRequestError

    worker = workers(build_command=worker_command())
    pid = worker.predict({"action": "echo"})["pid"]
    with pytest.raises(WorkerRequestError, match="cannot be sent"):
        worker.predict({"action": "nan"})
    with pytest.raises(WorkerRequestError, match="over the protocol cap"):
        worker.predict({"action": "big", "bytes": protocol.MAX_LINE_BYTES + 10})
    assert worker.predict({"action": "echo"})["pid"] == pid


def test_no_pickle_and_no_shell_anywhere_a_request_or_manifest_reaches():
    package = ROOT / "resident_pool"
    offenders = []
    for path in [*package.rglob("*.py"), *(ROOT / "flows").rglob("*.py")]:
        text = path.read_text()
        if re.search(r"^\s*(import pickle|from pickle|import cPickle)", text, re.MULTILINE) or "pickle.load" in text:
            offenders.append(f"{path}: pickle")
        if re.search(r"shell\s*=\s*True", text) or "os.system(" in text or "os.popen(" in text:
            offenders.append(f"{path}: a shell")
    assert not offenders, offenders


BAD_REPLIES = ["garbage", "not_object", "other_id", "huge", "regular_file", "pipe", "socket", "dev_zero",
               "unsealed_memfd", "wrong_size", "offset_past_end", "many_fds"]


def test_every_bad_reply_of_a_worker_is_a_library_error_naming_it_and_costs_no_wait_on_the_pool(pool_dir,
                                                                                                  reliability_row):
    """Issue 31, finding 10: each of these raised resident_pool.protocol.ProtocolError (no ResidentPoolError, no
    provider named) and took about 2 s, the client waiting on the pool's answer to a broken release (which waits
    DEATH_WAIT_S for a death). A worker not built on worker_base, or a buggy one, is enough."""
    from resident_pool import Pool
    from resident_pool.errors import WorkerRequestError
    from resident_pool.providers.worker_process import DEATH_WAIT_S

    write_provider(pool_dir, "bad", "", worker="bad_replies.py")
    with Pool() as pool:
        assert pool.predict("bad", {"bad": "none"})["good"]
        started = time.monotonic()
        for kind in BAD_REPLIES:
            with pytest.raises(WorkerRequestError) as info:
                pool.predict("bad", {"bad": kind})
            error = info.value
            assert (error.slug, error.reason) == ("bad", "bad_reply"), (kind, error)
            assert error.transcript and "cannot be read" in error.headline and "may have run" in error.headline
            assert pool.predict("bad", {"bad": "none"})["good"], kind  # its worker serves the next request
        took = time.monotonic() - started
    # Each bad reply waited DEATH_WAIT_S before: now a round trip (and the pool's ping of the worker) each.
    assert took < DEATH_WAIT_S * len(BAD_REPLIES) / 4, f"{len(BAD_REPLIES)} bad replies and the calls after took {took:.1f} s"
    reliability_row(f"worker sends {len(BAD_REPLIES)} kinds of malformed reply",
                    "WorkerRequestError(bad_reply) naming the provider and transcript; next call served",
                    seconds_each=round(took / len(BAD_REPLIES), 3))


def test_a_reply_to_a_request_no_longer_waited_for_is_skipped_not_taken_for_the_next(pool_dir):
    """Issue 31, finding 10: a stray reply line after a correct one made the next valid call fail with "the worker
    answered request -5, not 87"."""
    from resident_pool import Pool

    write_provider(pool_dir, "bad", "", worker="bad_replies.py")
    with Pool() as pool:
        assert pool.predict("bad", {"bad": "extra_after"})["good"]
        assert pool.predict("bad", {"bad": "none"})["good"]
        assert pool.predict("bad", {"bad": "stale_then_good"})["good"]
        with pool.session("bad") as session:
            assert session.predict({"bad": "extra_after"})["good"] and session.predict({})["good"]
