"""AsyncPool: the lane its coroutines share (unit tests, no processes), then real pool, client and worker processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from providers import write_provider
from test_buffers import array_provider

from resident_pool import AsyncPool, Pool, RequestTimeout, ResidentPoolError, WorkerRequestError
from resident_pool.aio.links import Lane
from resident_pool.errors import AdmissionTimeout


async def until(condition, timeout=30.0, message="condition"):
    """helpers.wait_until for a coroutine: poll ``condition`` (a coroutine function) on the loop until a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        await asyncio.sleep(0.02)


# -- the lane: who gets a kept lease, and who asks the pool for another --------------------------------------------
class FakeLease:
    def __init__(self, name="lease", kept=True):
        self.name, self.lease, self._ended = name, {"kept": kept}, False


async def never():
    raise AssertionError("this call must wait for a lease, not acquire one")


def test_a_lease_given_back_goes_to_the_waiters_in_priority_order_then_arrival():
    async def scenario():
        lane = Lane()
        first = FakeLease()

        async def acquire():
            return first

        held = await lane.take("normal", acquire)
        lane.full_until = time.monotonic() + 60  # every replica is held: calls wait for a lease, none acquires
        served = []

        async def call(name, priority):
            lease = await lane.take(priority, never)
            served.append(name)
            lane.give(lease)

        calls = [asyncio.create_task(call(name, priority)) for name, priority in
                 (("batch", "batch"), ("normal 1", "normal"), ("interactive", "interactive"), ("normal 2", "normal"))]
        await asyncio.sleep(0)  # each call has looked, and waits
        assert len(lane.waiters) == 4
        lane.give(held)
        await asyncio.gather(*calls)
        return served, lane

    served, lane = asyncio.run(scenario())
    assert served == ["interactive", "normal 1", "normal 2", "batch"]
    assert lane.idle() and not lane.waiters


def test_one_acquire_at_a_time_per_class_and_a_refusal_reaches_those_who_waited_for_it():
    """100 calls find no lease: one asks the pool, the other 99 wait for its answer instead of asking 99 times; when
    the pool refuses and the lane holds nothing to hand over, each of them gets the refusal (its own copy)."""
    async def scenario():
        lane = Lane()
        asked = []
        answer = asyncio.get_running_loop().create_future()

        async def acquire():
            asked.append(1)
            await answer
            raise AdmissionTimeout("t: waited 600 s for 6 GB", slug="t")

        calls = [asyncio.create_task(lane.take("normal", acquire)) for _ in range(100)]
        await asyncio.sleep(0)
        assert len(asked) == 1 and len(lane.waiters) == 99
        answer.set_result(None)
        results = await asyncio.gather(*calls, return_exceptions=True)
        return asked, results

    asked, results = asyncio.run(scenario())
    assert len(asked) == 1
    assert all(isinstance(r, AdmissionTimeout) and r.slug == "t" for r in results)
    assert len({id(r) for r in results}) == 100


def test_a_call_cancelled_while_it_acquires_hands_the_acquire_to_the_next_waiter():
    async def scenario():
        lane = Lane()
        leases = iter([FakeLease("second")])
        stuck = asyncio.get_running_loop().create_future()

        async def hangs():
            await stuck

        async def acquire():
            return next(leases)

        first = asyncio.create_task(lane.take("normal", hangs))
        await asyncio.sleep(0)
        second = asyncio.create_task(lane.take("normal", acquire))
        await asyncio.sleep(0)
        first.cancel()
        got = await second
        with pytest.raises(asyncio.CancelledError):
            await first
        return got, lane

    got, lane = asyncio.run(scenario())
    assert got.name == "second" and lane.leases == [got] and not lane.acquiring


def test_an_acquire_granted_by_taking_back_one_of_the_lanes_own_leases_marks_the_lane_full():
    """Every replica the pool may run is held by this lane: a further acquire is granted only once the pool takes
    one of the lane's leases back. The lane then stops asking for FULL_S, where it would otherwise take its own
    leases back one after another."""
    async def scenario():
        lane = Lane()
        own = FakeLease("own")

        async def acquire_own():
            return own

        await lane.take("normal", acquire_own)  # held by a call
        taken_back = FakeLease("granted")

        async def acquire_by_recall():
            own._ended = True  # the pool took the lane's lease back (its call hears lease_recalled)...
            lane.give(own)
            return taken_back  # ...and granted its replica to this acquire

        await lane.take("normal", acquire_by_recall)
        return lane

    lane = asyncio.run(scenario())
    assert lane.lost == 1 and lane.full_until > time.monotonic()


# -- through a real pool -------------------------------------------------------------------------------------------
@pytest.mark.smoke
def test_100_coroutines_on_one_loop_each_get_their_own_answer_and_no_call_waits_on_a_thread(pool_dir):
    """100 calls at once on a cold pool and a provider of 2 replicas: each answer is its own input's, and while
    they wait (for the pool to start, for admission, for a worker) the process has no more threads than before but
    the one that started the pool process."""
    write_provider(pool_dir, "two", "[lifecycle]\nmax_replicas = 2\n")

    async def scenario():
        threads = [threading.active_count()]
        done = asyncio.Event()

        async def count_threads():
            while not done.is_set():
                threads.append(threading.active_count())
                await asyncio.sleep(0.002)

        async with AsyncPool() as pool:
            counting = asyncio.create_task(count_threads())
            answers = await asyncio.gather(*(pool.predict("two", {"action": "echo", "value": n}) for n in range(100)))
            done.set()
            await counting
            lanes = [len(here.lanes["two"].leases) for here in pool._locals.values()]
        return threads, answers, lanes

    threads, answers, lanes = asyncio.run(scenario())
    assert [answer["echo"] for answer in answers] == list(range(100))
    assert len({answer["pid"] for answer in answers}) == 2, "both replicas served"
    # One lease per replica, not one per call; a third only where the pool took one of them back meanwhile (a
    # worker replaced on a loaded host) and no call has used the ended one since to drop it (seen once in a full run).
    assert len(lanes) == 1 and 2 <= lanes[0] <= 3, f"the loop kept {lanes} leases, not one per replica"
    assert max(threads) <= threads[0] + 1, f"threads went from {threads[0]} to {max(threads)}"
    assert len(threads) > 10, "the thread count was sampled while the calls waited"


def test_a_session_holds_one_worker_and_takes_concurrent_calls_one_at_a_time(pool_dir):
    write_provider(pool_dir, "held", "[lifecycle]\nmax_replicas = 2\n")

    async def scenario():
        async with AsyncPool() as pool:
            async with pool.session("held") as session:
                answers = await asyncio.gather(*(session.predict({"action": "echo", "value": n}) for n in range(20)))
                (worker,) = (await pool.status())["workers"]
                during = worker["state"], (worker["lease"] or {}).get("id")

            async def released():  # the release goes without waiting for an answer, status on another connection
                return (await pool.status())["workers"][0]["state"] == "ready"

            after = await until(released, message="the session's worker to be ready again")
            with pytest.raises(WorkerRequestError) as ended:
                await session.predict({"action": "echo"})
        return session, answers, during, after, ended.value

    session, answers, during, after, ended = asyncio.run(scenario())
    assert [answer["echo"] for answer in answers] == list(range(20))
    assert {answer["pid"] for answer in answers} == {session.pid}
    assert during[0] == "leased" and during[1] is not None and session.served == 20
    assert after and ended.reason == "session_ended"


def test_arrays_travel_as_attachments_and_come_back_bit_exact(pool_dir):
    array_provider(pool_dir)
    rng = np.random.default_rng(7)
    big = rng.standard_normal((300, 300)).astype(np.float32)  # 360 KB: a descriptor beside the line
    small = rng.integers(-128, 127, size=(7, 3), dtype=np.int8)  # inline
    blob = rng.bytes(100_000)

    async def scenario():
        async with AsyncPool() as pool:
            kept = await pool.predict("arrays", {"action": "echo", "value": {"big": big, "small": small,
                                                                             "blob": blob}})
            async with pool.session("arrays") as session:
                echoed = await session.predict({"action": "echo", "value": big})
                made = await session.predict({"action": "make", "dtype": "uint16", "shape": [512, 256],
                                              "nbytes": 512 * 256 * 2, "hex": "0102a0ff"})
        return kept["value"], echoed["value"], made["value"]

    kept, echoed, made = asyncio.run(scenario())
    for sent, back in ((big, kept["big"]), (small, kept["small"]), (big, echoed)):
        assert back.dtype == sent.dtype and back.shape == sent.shape and back.tobytes() == sent.tobytes()
    assert kept["blob"] == blob
    assert made.dtype == np.uint16 and made.shape == (512, 256)
    assert made.tobytes() == (bytes.fromhex("0102a0ff") * (512 * 256 * 2 // 4))


def test_a_kept_lease_taken_back_or_its_worker_stopped_is_acquired_again_unseen(pool_dir):
    """One replica: another client's call makes the pool take the loop's kept lease back (between its calls), and
    a stop ends its worker; each next call acquires again without the caller seeing either."""
    write_provider(pool_dir, "one", "")
    loop = asyncio.new_event_loop()
    pool = AsyncPool()
    try:
        first = loop.run_until_complete(pool.predict("one", {"action": "echo", "value": 1}))
        kept = loop.run_until_complete(pool.status())["workers"][0]["lease"]["id"]
        with Pool() as other:  # waits: the pool recalls the kept lease, idle between its calls, and grants it here
            theirs = other.predict("one", {"action": "echo", "value": 2})
        again = loop.run_until_complete(pool.predict("one", {"action": "echo", "value": 3}))
        now = loop.run_until_complete(pool.status())["workers"][0]["lease"]["id"]
        with Pool() as operator:
            operator.stop("one", now=True)
        restarted = loop.run_until_complete(pool.predict("one", {"action": "echo", "value": 4}))
        loop.run_until_complete(pool.aclose())
    finally:
        loop.close()
    assert theirs["pid"] == first["pid"], "the other client was served by the same worker, taken back from the lane"
    assert again == {"echo": 3, "pid": first["pid"]} and now != kept
    assert restarted["echo"] == 4 and restarted["pid"] != first["pid"]


def test_a_task_cancelled_mid_request_frees_its_worker_and_the_next_call_is_served(pool_dir, tmp_path):
    write_provider(pool_dir, "one", "")
    marker = tmp_path / "let-go"

    async def scenario():
        async with AsyncPool() as pool:
            call = asyncio.create_task(pool.predict("one", {"action": "hold", "until": str(marker), "seconds": 60}))

            async def worker_state():
                workers = (await pool.status())["workers"]
                return workers[0] if workers and workers[0].get("in_flight_s") is not None else None

            busy = await until(worker_state, message="the request in flight")
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

            async def draining():
                return [w for w in (await pool.status())["workers"] if w["state"] == "draining"]

            (drained,) = await until(draining, message="the pool to drain the abandoned worker")
            marker.write_text("")  # the abandoned request ends
            answer = await pool.predict("one", {"action": "echo", "value": "next"})
            return busy, drained, answer

    busy, drained, answer = asyncio.run(scenario())
    assert drained["pid"] == busy["pid"] and drained["lease"] is None
    assert answer["echo"] == "next"


def test_a_timeout_and_a_worker_killed_mid_request_are_the_librarys_own_errors(pool_dir):
    write_provider(pool_dir, "slow", "[lifecycle]\nrequest_timeout_s = 1\n")

    async def scenario():
        async with AsyncPool() as pool:
            first = await pool.predict("slow", {"action": "echo"})
            with pytest.raises(RequestTimeout) as timed_out:
                await pool.predict("slow", {"action": "sleep", "seconds": 5})
            after_timeout = await pool.predict("slow", {"action": "echo", "value": 1})
            async with pool.session("slow") as session:
                with pytest.raises(WorkerRequestError) as killed:
                    await session.predict({"action": "sigkill"})
            after_kill = await pool.predict("slow", {"action": "echo", "value": 2})
        return first, timed_out.value, after_timeout, killed.value, after_kill

    first, timed_out, after_timeout, killed, after_kill = asyncio.run(scenario())
    assert isinstance(timed_out, TimeoutError) and timed_out.slug == "slow" and "request_timeout_s = 1" in str(
        timed_out)
    assert after_timeout["echo"] == 1 and after_timeout["pid"] != first["pid"]
    assert killed.reason == "worker_died" and "SIGKILL" in str(killed), str(killed)
    assert after_kill["echo"] == 2 and after_kill["pid"] != after_timeout["pid"]


def test_an_admission_wait_reaches_on_wait_and_the_request_is_served_once_memory_frees(pool_dir, monkeypatch):
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug in ("a6", "b6"):
        write_provider(pool_dir, slug, '[gpu]\npolicy = "required"\nvram_budget_gb = 6\n')

    async def scenario():
        waits = []

        async def on_wait(wait):  # a coroutine function: awaited
            waits.append(wait)

        async with AsyncPool(on_wait=on_wait) as pool:
            async with pool.session("a6") as holder:
                await holder.predict({"action": "echo"})
                waiter = asyncio.create_task(pool.predict("b6", {"action": "echo", "value": "admitted"}))

                async def heard():
                    return waits

                await until(heard, message="the admission wait's progress")
            return waits, await waiter

    waits, answer = asyncio.run(scenario())
    assert waits[0]["slug"] == "b6" and waits[0]["needs_gb"] == 6
    assert answer["echo"] == "admitted"


def test_a_backfilled_session_hears_the_pools_recall_and_waits_again_unseen(pool_dir, monkeypatch):
    """big (8 GB) is held, big2 (9) waits, small (2) is backfilled ahead of it. Once big is free, big2 needs small's
    memory: the pool's recall line reaches small's session, whose next request waits again, unseen by its caller."""
    monkeypatch.setenv("RESIDENT_POOL_GPU_CAPACITY_GB", "10")
    for slug, budget in (("big", 8), ("big2", 9), ("small", 2)):
        write_provider(pool_dir, slug, f'[gpu]\npolicy = "required"\nvram_budget_gb = {budget}\n'
                                       "[lifecycle]\nadmission_timeout_s = 120\n")

    async def scenario():
        async with AsyncPool() as pool:
            async def hold_big():
                async with pool.session("big") as session:
                    await session.predict({"action": "sleep", "seconds": 1.0})

            async def state(slug, wanted):
                return [w for w in (await pool.status())["workers"] if w["slug"] == slug and w["state"] == wanted]

            async def big2_waits():
                return [w for w in await pool.waiting() if w["slug"] == "big2" and w.get("needs_gb")]

            big = asyncio.create_task(hold_big())
            await until(lambda: state("big", "leased"), message="big busy")
            big2 = asyncio.create_task(pool.predict("big2", {"action": "echo", "value": "big2"}))
            await until(big2_waits, message="big2 waiting for memory")
            async with pool.session("small") as small:
                backfilled = small.backfilled
                answers = [await small.predict({"action": "echo", "value": n}) for n in range(3)]
                await big
                await until(lambda: state("big2", "leased"), message="big2 served, small's memory taken back")
                answers.append(await small.predict({"action": "echo", "value": 3}))
                recalls = small.recalls
            return backfilled, answers, recalls, await big2

    backfilled, answers, recalls, big2 = asyncio.run(scenario())
    assert backfilled is True and recalls == 1
    assert [answer["echo"] for answer in answers] == [0, 1, 2, 3] and big2["echo"] == "big2"


def test_a_priority_that_is_not_a_class_is_refused_naming_the_classes(pool_dir):
    async def scenario():
        async with AsyncPool() as pool:
            await pool.predict("any", {}, priority="urgent")

    with pytest.raises(ResidentPoolError, match="not a class: one of interactive, normal, batch"):
        asyncio.run(scenario())


FORKED = textwrap.dedent(
    """
    import asyncio, json, os
    from resident_pool import AsyncPool, WorkerRequestError
    pool = AsyncPool()

    def child(session):
        async def run():
            try:
                await session.predict({"action": "echo"})
                said = "answered"
            except WorkerRequestError as error:
                said = error.reason
            session.release()
            await pool.aclose()
            return said
        print(json.dumps({"child": asyncio.run(run())}), flush=True)

    def fork(session):
        pid = os.fork()
        if pid == 0:  # only this thread goes on in the child: its own loop, not the parent's running one
            child(session)
            os._exit(0)
        os.waitpid(pid, 0)

    async def main():
        await pool.predict("kept", {"action": "echo", "value": "warm"})  # a kept lease, made before the fork
        async with pool.session("held") as session:
            await session.predict({"action": "echo"})
            leases = lambda status: {w["slug"]: (w["state"], (w["lease"] or {}).get("id")) for w in status["workers"]}
            before = leases(await pool.status())
            await asyncio.to_thread(fork, session)
            after = leases(await pool.status())
            print(json.dumps({"before": before, "after": after,
                              "again": await session.predict({"action": "echo", "value": 2}),
                              "kept": (await pool.predict("kept", {"action": "echo", "value": 3}))["echo"]}),
                  flush=True)
        await pool.aclose()

    asyncio.run(main())
    """
)


def test_a_forked_child_gives_back_none_of_the_parents_leases(pool_dir):
    """An AsyncPool made before a fork: in the child a session of the parent's refuses (``session_forked``), and its
    release and ``aclose()`` send nothing for the parent's session or kept lease; the parent goes on with both."""
    write_provider(pool_dir, "kept", "")
    write_provider(pool_dir, "held", "")
    proc = subprocess.run([sys.executable, "-c", FORKED], check=False, capture_output=True, text=True, timeout=90,
                          start_new_session=True)
    said = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(said) == 2, (proc.stdout, proc.stderr[-800:])
    child, parent = said
    assert child == {"child": "session_forked"}
    assert parent["after"] == parent["before"], "the child gave back a lease of its parent's"
    assert parent["before"]["held"][0] == "leased" and parent["before"]["kept"][0] == "leased"
    assert parent["again"]["echo"] == 2 and parent["kept"] == 3
