"""The pool's accept loop: it returns when woken, not a tick later (a stopped pool exits when its workers are gone)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from helpers import wait_until

from resident_pool.protocol import send_line
from resident_pool.server.wire import Wire


def _wire(short_tmp, tick_s: float) -> Wire:
    return Wire(os.path.join(short_tmp, "pool.sock"), {}, frozenset(), lambda conn: None, max_connections=8,
                keepalive_s=10.0, tick_s=tick_s, log_hint="pool.log")


def _accept_in_a_thread(wire: Wire) -> threading.Thread:
    thread = threading.Thread(target=wire.accept_once, args=(0.0,), daemon=True)
    thread.start()
    return thread


def test_a_wake_ends_the_accept_loops_wait_with_a_tick_of_an_hour_so_only_the_wake_can_end_it(short_tmp):
    wire = _wire(short_tmp, tick_s=3600.0)
    wire.bind()
    try:
        thread = _accept_in_a_thread(wire)
        wire.wake()
        wait_until(lambda: not thread.is_alive(), timeout=10, message="accept_once to return after wake()")
        for _ in range(100_000):
            wire.wake()  # woken more often than the pipe holds: the waker never blocks
        assert wire.accept_once(0.0) == 0.0
        thread = _accept_in_a_thread(wire)
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(wire.socket_path)  # a client still ends the wait as before
            wait_until(lambda: not thread.is_alive(), timeout=10, message="accept_once to accept the client")
    finally:
        wire.close()
    wire.wake()  # after close: a no-op, never a write to a descriptor that may be someone else's now
    assert not os.path.exists(wire.socket_path)


def test_the_loop_ends_only_once_the_shutdown_ops_own_reply_is_sent(short_tmp):
    """Woken at once, the pool's exit cut off the reply to `shutdown` (seen under load: 2 of 40 shutdowns ended in
    ConnectionResetError): the loop waits for the replies of the ops it read, not only for `finished`."""
    finished = threading.Event()
    wire = _wire(short_tmp, tick_s=0.25)

    def shutdown(message, connection):
        finished.set()
        wire.wake()
        time.sleep(0.3)  # the handler's own work after the stop began (a scene: nothing to wait on)
        return {"ok": True, "pid": os.getpid()}

    wire.handlers["shutdown"] = shutdown
    wire.bind()
    loop = threading.Thread(target=wire.serve_until, args=(finished, lambda: None), daemon=True)
    loop.start()
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(wire.socket_path)
            send_line(client, {"op": "shutdown"})
            wait_until(lambda: not loop.is_alive(), timeout=15, message="the loop to end")
            client.setblocking(False)
            assert json.loads(client.recv(65536)) == {"ok": True, "pid": os.getpid()}  # there when the loop ended
    finally:
        wire.close()
