"""The decision core at its boundary, with a fake clock: a check's variant ends with its run, events are the core's
input and never changed by it, and the one view it hands out (built once per look, linear in the replicas)."""

from __future__ import annotations

import json

import pytest
from test_core import CONN, Clock, of, one

from resident_pool.errors import WorkerStartError
from resident_pool.server import actions as c
from resident_pool.server import events as ev
from resident_pool.server.actions import Timings
from resident_pool.server.core import PoolState
from resident_pool.server.corelog import encode
from resident_pool.server.replica import Spec
from resident_pool.server.states import ReplicaState, StopCause

R = ReplicaState


@pytest.fixture
def clock():
    return Clock()


# -- a check's variant ------------------------------------------------------------------------------------
def _with_variant(clock: Clock, spec: Spec) -> PoolState:
    state = PoolState(Timings(keep_warm_s=5), clock())
    state.handle(clock(), ev.ManifestRead("m", "m", "v", "f", Spec()))
    state.handle(clock(), ev.ManifestRead("m~stock", "m", "v", "f", spec, variant=True))
    return state


def test_a_variant_is_never_topped_up_to_its_manifests_min_replicas(clock):
    state = _with_variant(clock, Spec(min_replicas=1))
    clock.advance(5)
    assert of(state.handle(clock(), ev.Tick()).actions, c.Start) == []  # a check's run, not a provider kept warm


def test_a_variants_idle_worker_retires_whatever_min_replicas_its_manifest_says(clock):
    state = _with_variant(clock, Spec(min_replicas=1, idle_timeout_s=1, ping_interval_s=10_000))
    ask = state.handle(clock(), ev.ClientAsked("m~stock", CONN, {}))
    start = one(ask.actions, c.Start)
    grant = one(state.handle(clock(), ev.WorkerStarted(start.rid, 7)).actions, c.Grant)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    assert not state.view(clock()).replica(start.rid).kept_warm
    clock.advance(2)
    assert one(state.handle(clock(), ev.Tick()).actions, c.Stop).cause is StopCause.IDLE


def test_a_variant_gone_with_its_last_replica_tells_the_shell_to_forget_its_manifest(clock):
    state = _with_variant(clock, Spec(idle_timeout_s=1, ping_interval_s=10_000))
    start = one(state.handle(clock(), ev.ClientAsked("m~stock", CONN, {})).actions, c.Start)
    grant = one(state.handle(clock(), ev.WorkerStarted(start.rid, 7)).actions, c.Grant)
    state.handle(clock(), ev.LeaseReleased(grant.lease, CONN, "ok"))
    clock.advance(2)
    one(state.handle(clock(), ev.Tick()).actions, c.Stop)
    actions = state.handle(clock(), ev.WorkerStopped(start.rid)).actions
    assert one(actions, c.Forget).key == "m~stock"
    assert "m~stock" not in state.view(clock()).providers and "m" in state.view(clock()).providers


# -- events are the core's input, never changed by it --------------------------------------------------------
def test_a_start_failure_that_opens_the_breaker_leaves_the_event_as_it_came(clock):
    state = PoolState(Timings(breaker_cooldown_s=300), clock())
    state.handle(clock(), ev.ManifestRead("m", "m", "v", "f", Spec()))
    ask = state.handle(clock(), ev.ClientAsked("m", CONN, {}))
    start = one(ask.actions, c.Start)
    failed = ev.StartFailed(start.rid, WorkerStartError("m: exited 3: refused", slug="m", exit_code=3,
                                                        details={"transcript_lines": 2}))
    before = json.dumps(encode(failed))
    decision = state.handle(clock(), failed)
    assert json.dumps(encode(failed)) == before  # logged, and replayed, as the runtime reported it
    refusal = one(decision.actions, c.Refuse).error
    assert refusal.details == {"transcript_lines": 2, "breaker_opened": True} and refusal.headline == \
        failed.error.headline
    assert decision.error is refusal  # the events stream says `breaker.open` once, and the client hears its id


@pytest.mark.parametrize("asked", [ev.ClientAsked("m~stock", CONN, {}), ev.WarmAsked("m~stock", 1)],
                         ids=["ClientAsked", "WarmAsked"])
def test_asking_for_a_variant_forgotten_since_its_manifest_was_read_is_answered_not_a_key_error(clock, asked):
    state = _with_variant(clock, Spec())
    start = one(state.handle(clock(), ev.WarmAsked("m~stock", 1)).actions, c.Start)
    state.handle(clock(), ev.StartFailed(start.rid, WorkerStartError("m: exited 1", slug="m", exit_code=1)))
    assert "m~stock" not in state.view(clock()).providers  # gone with its last replica
    decision = state.handle(clock(), asked)
    assert decision.error is not None and decision.error.reason == "provider_gone"
    assert decision.actions == [] and decision.ticket is None


# -- the one view: cheap to build, built once per decision ----------------------------------------------------
def _many(clock: Clock, replicas: int) -> PoolState:
    state = PoolState(Timings(), clock())
    state.handle(clock(), ev.ManifestRead("m", "m", "v", "f", Spec(max_replicas=replicas, min_replicas=replicas)))
    for start in state.handle(clock(), ev.WarmAsked("m", replicas)).actions:
        state.handle(clock(), ev.WorkerStarted(start.rid, 1000 + start.rid))
    return state


def test_a_view_of_64_replicas_asks_each_whether_it_serves_a_bounded_number_of_times(clock, monkeypatch):
    from resident_pool.server.lifecycle import Lifecycle

    state = _many(clock, 64)
    asked = []
    serving = Lifecycle.serving
    monkeypatch.setattr(Lifecycle, "serving", lambda self, r: asked.append(r.rid) or serving(self, r))
    view = state.view(clock())
    assert sum(r.kept_warm for r in view.replicas) == 64 and view.providers["m"].serving == 64
    assert len(asked) <= 3 * 64  # linear: kept_warm sorted its provider's replicas once per replica (4,000+ asks)


def test_the_runtime_builds_the_view_once_per_decision(clock, monkeypatch):
    from types import SimpleNamespace

    from resident_pool.server.runtime import Runtime

    state = _many(clock, 4)
    runtime = Runtime(state, None, None, None, None, None, None, SimpleNamespace(kill_grace_s=1.0), clock=clock)
    built = []
    view = PoolState.view
    monkeypatch.setattr(PoolState, "view", lambda self, now: built.append(now) or view(self, now))
    for _ in range(5):  # a session's path: draining, the manifest's read, the lease, the release...
        runtime.view()
        runtime.snapshot()
    assert len(built) == 1
    runtime.report(ev.LeaseUsed(1, CONN, 1))
    clock.advance(1)
    assert runtime.view().now == clock() and runtime.view() is runtime.view() and len(built) == 2


# -- idle: decided once, in the core -------------------------------------------------------------------------
def test_a_kept_lease_running_a_request_is_neither_idle_nor_counting_idle_time(clock):
    state = PoolState(Timings(), clock())
    state.handle(clock(), ev.ManifestRead("m", "m", "v", "f", Spec(ping_interval_s=10_000)))
    start = one(state.handle(clock(), ev.ClientAsked("m", CONN, {}, keep=True)).actions, c.Start)
    one(state.handle(clock(), ev.WorkerStarted(start.rid, 7, True)).actions, c.Grant)
    clock.advance(30)
    between_calls = state.view(clock()).replica(start.rid)
    assert between_calls.idle and between_calls.idle_s == 30.0
    state.handle(clock(), ev.Tick(in_flight={start.rid: 5.0}))  # a request runs on it now
    clock.advance(10)
    running = state.view(clock()).replica(start.rid)
    assert not running.idle and running.idle_s == 0.0  # one word, one meaning: the time agrees with the flag


def test_a_waiting_task_calls_busy_what_the_pool_says_serves_and_is_not_idle():
    from resident_pool.prefect import _waiting_words

    rows = [{"slug": "m", "replica": 0, "state": "leased", "serving": True, "idle": True},  # a kept lease, idle
            {"slug": "m", "replica": 1, "state": "leased", "serving": True, "idle": False},
            {"slug": "m", "replica": 2, "state": "draining", "serving": False, "idle": False}]
    assert "its 1 replica(s) are busy" in _waiting_words("m", {"workers": rows}, "3 s so far")
    older_pool = [{"slug": "m", "replica": 0, "state": "leased"}]  # a pool from before `serving` was said
    assert "its 1 replica(s) are busy" in _waiting_words("m", {"workers": older_pool}, "3 s so far")


def test_the_cores_boundary_is_typed_without_any():
    """Events in, a decision and one view out, and the runtime that reports them: no ``Any`` for mypy to wave through
    (the runtime's announcements reached the events stream untyped while its observer was ``Any``)."""
    import ast
    from pathlib import Path

    import resident_pool.server

    server = Path(resident_pool.server.__file__).parent
    loose = [f"{name}:{node.lineno}" for name in ("core.py", "events.py", "actions.py", "view.py")
             for node in ast.walk(ast.parse((server / name).read_text()))
             if isinstance(node, ast.Name) and node.id == "Any"]
    assert loose == []
    runtime = ast.parse((server / "runtime.py").read_text())
    init = next(n for n in ast.walk(runtime) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert all(ast.unparse(arg.annotation) != "Any" for arg in init.args.args if arg.annotation is not None)
