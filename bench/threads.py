"""Threads for bench cases: a case whose thread raised fails, it never prints rows from what was left."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class ThreadFailed(RuntimeError):
    """One or more of a case's threads raised: the first one's exception is the cause."""


def together(calls: list[Callable[[], Any]], timeout_s: float | None = None) -> float:
    """Run each call in a thread of its own, all started together; the seconds until the last ended.

    Raises ``ThreadFailed`` when any of them raised (or was still running after ``timeout_s``)."""
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run(call: Callable[[], Any]) -> None:
        try:
            call()
        except BaseException as exc:  # whatever it was, the case fails with it
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    elapsed = time.perf_counter() - started
    hung = sum(1 for thread in threads if thread.is_alive())
    if failures or hung:
        first = failures[0] if failures else None
        text = "".join(traceback.format_exception(first)).strip() if first else ""
        raise ThreadFailed(f"{len(failures)} of {len(threads)} thread(s) raised"
                           + (f", {hung} still ran after {timeout_s:g} s" if hung else "")
                           + (f"; the first:\n{text}" if text else "")) from first
    return elapsed


class Background:
    """One call on a thread of its own while the case goes on; ``join`` raises ``ThreadFailed`` if it raised."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._failure: BaseException | None = None

        def run() -> None:
            try:
                call()
            except BaseException as exc:  # handed to join, which fails the case with it
                self._failure = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ThreadFailed(f"a case's background call still ran after {timeout_s:g} s")
        if self._failure is not None:
            raise ThreadFailed(f"a case's background call raised: {self._failure!r}") from self._failure
