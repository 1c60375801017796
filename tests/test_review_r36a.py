"""Review r36a of the one-at-a-time call path (5590a0f, f9a9298): the fast encoder and decoder against the paths they
short-cut."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from resident_pool import arrays, protocol, worker_base
from resident_pool.protocol import ProtocolError


def test_a_circular_message_is_refused_not_a_crash_where_the_recursion_limit_is_raised():
    # json.dumps' markers find a cycle at its second visit; the plain encoder has none and goes down the cycle until
    # RecursionError. Under a raised limit (scientific code raises it) that is past the C stack: a segfault, in a
    # client's Prefect thread or a worker replying. The old path refused it with "Circular reference detected".
    code = textwrap.dedent("""
        import sys, threading
        from resident_pool import arrays
        sys.setrecursionlimit(1_000_000)
        threading.stack_size(8 << 20)  # Linux's usual thread stack
        circular = {}
        circular["self"] = circular
        def send():
            try:
                arrays.encode({"op": "predict", "payload": circular}, None)
            except ValueError as exc:
                print("refused:", exc)
        thread = threading.Thread(target=send)
        thread.start()
        thread.join()
    """)
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Circular reference detected" in done.stdout, (done.returncode,
                                                                                  done.stderr[-2000:])


class _Scans:
    """Counts the scans of a line: protocol's own and json.loads' (its default decoder's)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for owner, name in ((protocol, "_scan_once"), (json._default_decoder, "scan_once")):
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name)))

    def _counting(self, scan):
        def counted(text, index):
            self.count += 1
            return scan(text, index)
        return counted


@pytest.mark.parametrize(
    ("line", "words"),
    [(b'{"a": [' + b"{}," * 1000 + b'{}]} x', "Extra data"), (b'{"a": [' + b"{}," * 1000 + b'x]}', "Expecting value"),
     (b'{"a": [' + b"{}," * 1000 + b"1" * 5000 + b"]}", "Exceeds the limit")],
)
def test_a_bad_line_is_scanned_once(monkeypatch, line, words):
    # A line the fast scan does not take whole went through json.loads again: a junk byte after a line of up to the
    # 64 MiB cap cost two scans, and the first decoded object was still alive during the second (peak memory x2).
    scans = _Scans(monkeypatch)
    with pytest.raises(ProtocolError, match=words):
        protocol._decode(line)
    assert scans.count == 1


def test_a_line_with_whitespace_after_it_is_scanned_once(monkeypatch):
    scans = _Scans(monkeypatch)
    assert protocol._decode(b'{"a": [1, 2]}\r \t') == {"a": [1, 2]}
    assert scans.count == 1


class _Counted(dict):
    """A dict that counts how often an encoder walks it."""

    walks = 0

    def items(self):
        _Counted.walks += 1
        return super().items()


@pytest.mark.parametrize("kind", ["array", "over the cap"])
def test_a_worker_reply_the_plain_encoder_cannot_take_is_tried_on_it_once(monkeypatch, kind):
    # The outbox tries plain_line, then arrays.encode tries it again before the whole path: three walks of the reply
    # where the design says two (plain, then whole).
    if kind == "array":
        result = {"meta": _Counted(n=1), "x": np.arange(4.0)}
    else:
        monkeypatch.setattr(protocol, "MAX_LINE_BYTES", 1000)
        result = {"meta": _Counted(n=1), "x": "y" * 2000}
    _Counted.walks = 0
    outbox = worker_base._Outbox("echo", protocol, arrays, None, selectors.DefaultSelector())
    raw, fds, fresh, _ = outbox.encode({"ok": True, "id": 1, "result": result}, None, (), None)
    reply = json.loads(raw)
    assert reply["ok"] if kind == "array" else "over the protocol cap" in reply["error"]
    assert fds == [] and fresh is None and _Counted.walks <= 2


def test_a_worker_reply_too_deep_to_encode_fails_its_request_not_the_worker():
    # Found beside the review, older than it: RecursionError is neither ValueError nor TypeError, so it left
    # Outbox.encode, and the serve loop with it (the worker ends, and with it every caller's item in a shared batch).
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    outbox = worker_base._Outbox("echo", protocol, arrays, None, selectors.DefaultSelector())
    raw, _, _, _ = outbox.encode({"ok": True, "id": 1, "result": deep}, None, (), None)
    reply = json.loads(raw)
    assert not reply["ok"] and reply["reason"] == "request_failed" and "recursion" in reply["error"]
