"""The start-failure breaker, with the time passed in."""

from __future__ import annotations

from resident_pool.server.breaker import Breaker

ERROR = {"type": "WorkerStartError", "error": "demo: the worker exited", "headline": "demo: the worker exited"}
T0 = 1000.0


def test_three_failed_starts_in_a_row_open_it_and_the_cooldown_closes_it():
    breaker = Breaker(cooldown_s=300)
    assert not breaker.failed("f1", ERROR, False, T0)
    assert not breaker.failed("f1", ERROR, False, T0)
    assert not breaker.is_open("f1", T0)
    assert breaker.failed("f1", ERROR, False, T0)
    assert breaker.is_open("f1", T0) and breaker.is_open("f1", T0)
    assert breaker.refused == 2 and breaker.remaining_s(T0) == 300
    assert breaker.is_open("f1", T0 + 299.9)
    assert not breaker.is_open("f1", T0 + 300.1)


def test_a_refusal_opens_it_at_once_and_status_names_the_time_left_as_such():
    breaker = Breaker(cooldown_s=300)
    assert breaker.failed("f1", ERROR, True, T0)
    assert breaker.is_open("f1", T0)
    assert breaker.snapshot(T0) == {"failures": 1, "open": True, "closes_in_s": 300.0, "refused": 1,
                                    "error": "demo: the worker exited"}


def test_failures_while_open_do_not_open_it_again():
    breaker = Breaker(cooldown_s=300)
    assert breaker.failed("f1", ERROR, True, T0)
    assert not breaker.failed("f1", ERROR, True, T0 + 10)  # one opening, one breaker.open event
    assert breaker.openings == 1 and breaker.remaining_s(T0 + 10) == 290


def test_a_changed_manifest_closes_it_and_starts_the_count_afresh():
    breaker = Breaker(cooldown_s=300)
    breaker.failed("f1", ERROR, True, T0)
    assert not breaker.is_open("f2", T0)
    assert breaker.failures == 0 and breaker.snapshot(T0) is None
    breaker.failed("f1", ERROR, False, T0)
    breaker.failed("f2", ERROR, False, T0)  # failures of another manifest do not add up
    assert breaker.failures == 1


def test_a_successful_start_resets_the_count():
    breaker = Breaker(cooldown_s=300)
    breaker.failed("f1", ERROR, False, T0)
    breaker.failed("f1", ERROR, False, T0)
    breaker.succeeded()
    assert not breaker.failed("f1", ERROR, False, T0)
    assert breaker.failures == 1
