"""The start-failure breaker, with a fake clock."""

from __future__ import annotations

from resident_pool.server.breaker import Breaker

ERROR = {"type": "WorkerStartError", "error": "demo: the worker exited", "headline": "demo: the worker exited"}


def make():
    now = [1000.0]
    return Breaker(cooldown_s=300, clock=lambda: now[0]), now


def test_three_failed_starts_in_a_row_open_it_and_the_cooldown_closes_it():
    breaker, now = make()
    assert not breaker.failed("f1", ERROR, refusal=False)
    assert not breaker.failed("f1", ERROR, refusal=False)
    assert not breaker.is_open("f1")
    assert breaker.failed("f1", ERROR, refusal=False)
    assert breaker.is_open("f1") and breaker.is_open("f1")
    assert breaker.refused == 2 and breaker.remaining_s() == 300
    now[0] += 299.9
    assert breaker.is_open("f1")
    now[0] += 0.2
    assert not breaker.is_open("f1")


def test_a_refusal_opens_it_at_once():
    breaker, _ = make()
    assert breaker.failed("f1", ERROR, refusal=True)
    assert breaker.is_open("f1")
    assert breaker.snapshot() == {"failures": 1, "open": True, "open_s": 300.0, "refused": 1,
                                  "error": "demo: the worker exited"}


def test_a_changed_manifest_closes_it_and_starts_the_count_afresh():
    breaker, _ = make()
    breaker.failed("f1", ERROR, refusal=True)
    assert not breaker.is_open("f2")
    assert breaker.failures == 0 and breaker.snapshot() is None
    breaker.failed("f1", ERROR, refusal=False)
    breaker.failed("f2", ERROR, refusal=False)  # failures of another manifest do not add up
    assert breaker.failures == 1


def test_a_successful_start_resets_the_count():
    breaker, _ = make()
    breaker.failed("f1", ERROR, refusal=False)
    breaker.failed("f1", ERROR, refusal=False)
    breaker.succeeded()
    assert not breaker.failed("f1", ERROR, refusal=False)
    assert breaker.failures == 1
