"""The rule that holds a batching worker's model call open (``max_wait_ms``), in the worker's queue with a fake
clock: a call waits only for the callers answered in the last call that have not asked again."""

from __future__ import annotations

import pytest

from resident_pool.worker_base import _Item, _Limits, _Queue


class _Message:
    def __init__(self, request_id: int) -> None:
        self.obj = {"id": request_id}


def _queue(monkeypatch, max_wait_ms: float, max_batch_size: int = 64) -> _Queue:
    for name in ("RESIDENT_POOL_MAX_BATCH_SIZE", "RESIDENT_POOL_MAX_WAIT_MS", "RESIDENT_POOL_MAX_BATCH_WORK"):
        monkeypatch.delenv(name, raising=False)
    return _Queue(_Limits("t", max_batch_size, max_wait_ms, None, None))


def _ask(queue: _Queue, conn: str, now: float) -> None:
    queue.put(_Item(conn, None, _Message(0), {}, 1, now))  # type: ignore[arg-type]


def _call(queue: _Queue, now: float, ended: float) -> list[str]:
    """The next call takes the queue at ``now`` and answers its callers at ``ended``."""
    taken = [item.conn for item in queue.take(now)]
    queue.answered(taken, ended)
    return taken  # type: ignore[return-value]


def test_a_lone_caller_is_never_held_even_with_a_wait(monkeypatch):
    queue = _queue(monkeypatch, 10)
    _ask(queue, "lone", 0.0)
    assert queue.due_in(0.0) == 0  # no call before: nobody to wait for
    _call(queue, 0.0, 0.020)
    _ask(queue, "lone", 0.021)
    assert queue.due_in(0.021) == 0  # every caller of the last call has asked again


def test_a_call_waits_for_the_callers_of_the_last_call_then_goes_when_all_have_asked(monkeypatch):
    queue = _queue(monkeypatch, 10)
    callers = [f"c{n}" for n in range(4)]
    for conn in callers:
        _ask(queue, conn, 0.0)
    assert _call(queue, 0.0, 0.020) == callers
    _ask(queue, "c0", 0.021)
    assert queue.due_in(0.021) == pytest.approx(0.010)  # three still to ask: held from the first's arrival
    _ask(queue, "c1", 0.022)
    _ask(queue, "c2", 0.023)
    assert queue.due_in(0.023) == pytest.approx(0.008)
    _ask(queue, "c3", 0.024)
    assert queue.due_in(0.024) == 0  # the last has asked: at once, not at 0.031
    assert _call(queue, 0.024, 0.040) == callers


def test_the_hold_ends_at_max_wait_ms_when_a_caller_of_the_last_call_never_asks_again(monkeypatch):
    queue = _queue(monkeypatch, 5)
    for conn in ("a", "b"):
        _ask(queue, conn, 0.0)
    _call(queue, 0.0, 0.010)
    _ask(queue, "a", 0.012)
    assert queue.due_in(0.016) == pytest.approx(0.001)
    assert queue.due_in(0.017) == 0
    assert _call(queue, 0.017, 0.030) == ["a"]
    _ask(queue, "a", 0.031)
    assert queue.due_in(0.031) == 0  # "b" was not in the last call: nobody is awaited


def test_a_request_queued_during_a_call_is_held_from_the_calls_end_for_the_callers_it_answers(monkeypatch):
    queue = _queue(monkeypatch, 5)
    for conn in ("a", "b", "c"):
        _ask(queue, conn, 0.0)
    _call(queue, 0.0, 0.050)
    _ask(queue, "late", 0.020)  # came while the call ran
    assert queue.due_in(0.050) == pytest.approx(0.005)  # a, b and c may still come back: until 0.055
    _ask(queue, "a", 0.051)
    _ask(queue, "b", 0.052)
    _ask(queue, "c", 0.053)
    assert queue.due_in(0.053) == 0
    assert sorted(_call(queue, 0.053, 0.070)) == ["a", "b", "c", "late"]


def test_a_full_call_a_caller_gone_and_no_wait_each_start_at_once(monkeypatch):
    queue = _queue(monkeypatch, 10, max_batch_size=2)
    for conn in ("a", "b", "c"):
        _ask(queue, conn, 0.0)
    _call(queue, 0.0, 0.010)  # a and b; c still queued
    _ask(queue, "a", 0.011)
    assert queue.due_in(0.011) == 0  # c and a fill a call of 2
    _call(queue, 0.011, 0.020)  # c and a
    _ask(queue, "c", 0.021)
    assert queue.due_in(0.021) == pytest.approx(0.010)
    queue.drop("a")  # its client went: nobody else to wait for
    assert queue.due_in(0.021) == 0
    unheld = _queue(monkeypatch, 0)
    for conn in ("a", "b"):
        _ask(unheld, conn, 0.0)
    _call(unheld, 0.0, 0.010)
    _ask(unheld, "a", 0.011)
    assert unheld.due_in(0.011) == 0  # max_wait_ms 0: never held
