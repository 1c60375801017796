"""The standalone worker's state table: every allowed move, every other move refused, and every edge taken."""

from __future__ import annotations

import itertools
import os
import signal
import threading

import pytest
from helpers import wait_until, worker_command

from resident_pool import WorkerRequestError, WorkerStartError
from resident_pool.providers.supervisor import ResidentWorker, WorkerTransitionError
from resident_pool.providers.worker_states import WORKER_EDGES, WorkerState


def never_built(worker):
    raise AssertionError("these tests start no process")


def worker_in(state: WorkerState) -> ResidentWorker:
    worker = ResidentWorker("demo", never_built)
    worker.state = state  # placed there directly: the test is of the move out of it
    return worker


ALLOWED = [(a, b) for a, targets in WORKER_EDGES.items() for b in sorted(targets)]
REFUSED = [(a, b) for a, b in itertools.product(WorkerState, WorkerState) if a is not b and b not in WORKER_EDGES[a]]


def test_the_table_names_every_state():
    assert set(WORKER_EDGES) == set(WorkerState)
    assert len(ALLOWED) == 15 and len(ALLOWED) + len(REFUSED) == len(WorkerState) ** 2 - len(WorkerState)


@pytest.mark.parametrize(("old", "new"), ALLOWED, ids=[f"{a}->{b}" for a, b in ALLOWED])
def test_an_allowed_move_happens(old, new):
    worker = worker_in(old)
    assert worker.transition(new, "because") is True
    assert worker.state is new


@pytest.mark.parametrize(("old", "new"), REFUSED, ids=[f"{a}->{b}" for a, b in REFUSED])
def test_any_other_move_raises_and_changes_nothing(old, new):
    worker = worker_in(old)
    with pytest.raises(WorkerTransitionError, match=f"demo\\[0\\]: {old} -> {new} is not an allowed move"):
        worker.transition(new, "because")
    assert worker.state is old


def test_a_move_asked_only_from_other_states_does_nothing():
    worker = worker_in(WorkerState.STOPPING)
    assert worker.transition(WorkerState.READY, only_from=(WorkerState.BUSY,)) is False  # a stop came first
    assert worker.state is WorkerState.STOPPING
    assert worker.transition(WorkerState.STOPPING) is False  # staying put is no move


def test_every_edge_of_the_table_is_taken_by_a_real_worker(workers):
    """Real processes down each path: no edge in the table is dead, and none outside it is taken."""
    taken: set[tuple[WorkerState, WorkerState]] = set()

    def recording(worker):
        move = worker.transition

        def transition(new, why="", only_from=None):
            old = worker.state
            moved = move(new, why, only_from)
            if moved:
                taken.add((old, new))
            return moved

        worker.transition = transition
        return worker

    def killed_behind_its_back(worker):
        os.kill(worker.pid, signal.SIGKILL)
        wait_until(lambda: not worker.is_running(), message="the worker to die")

    failures = []

    def in_thread(call):
        def run():
            try:
                call()
            except (WorkerStartError, WorkerRequestError) as exc:
                failures.append(exc.reason)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    worker = recording(workers(build_command=worker_command()))
    worker.predict({"action": "echo"})  # stopped -> starting -> ready -> busy -> ready
    worker.stop()  # ready -> stopping -> stopped
    worker.predict({"action": "echo"})  # stopped -> starting
    with pytest.raises(WorkerRequestError, match="died mid-request"):
        worker.predict({"action": "os_exit", "code": 7})  # busy -> exited
    worker.predict({"action": "echo"})  # exited -> starting
    killed_behind_its_back(worker)
    worker.predict({"action": "echo"})  # ready -> exited (found dead), then a fresh start
    with pytest.raises(WorkerRequestError, match="died mid-request"):
        worker.predict({"action": "os_exit", "code": 7})
    worker.stop()  # exited -> stopping

    busy = recording(workers(build_command=worker_command()))
    busy.predict({"action": "echo"})
    request = in_thread(lambda: busy.predict({"action": "sleep", "seconds": 60}))
    wait_until(lambda: busy.state is WorkerState.BUSY and "action sleep" in busy.transcript.read_text(),
               message="the request to be in flight in the worker")
    busy.stop(grace_s=1.0)  # busy -> stopping
    request.join(timeout=30)

    failing = recording(workers(build_command=worker_command("--exit-before-bind", "3")))
    with pytest.raises(WorkerStartError):
        failing.ensure_started()  # starting -> failed
    failing.build_command = worker_command()
    failing.predict({"action": "echo"})  # failed -> starting
    failing.build_command = worker_command("--exit-before-bind", "3")
    killed_behind_its_back(failing)
    with pytest.raises(WorkerStartError):
        failing.ensure_started()
    failing.stop()  # failed -> stopping

    hanging = recording(workers(build_command=worker_command("--hang-at-start"), start_timeout_s=60))
    start = in_thread(hanging.ensure_started)
    wait_until(lambda: hanging.pid is not None, message="the hanging worker to be spawned")
    hanging.stop(grace_s=1.0)  # starting -> stopping
    start.join(timeout=30)

    assert failures == ["worker_stopped", "start_failed"]  # the stopped request, the stopped start
    assert taken == set(ALLOWED)
