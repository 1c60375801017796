"""The asyncio client against the blocking one, on the echo provider, in one run.

Latency: ``await AsyncPool.predict`` and ``Pool.predict`` taken in turn on one thread (each a warm kept lease on a
replica of its own), so a busy moment of the shared host falls on both alike; beside them, the same turns on a
plain echo socket (bench/echo_floor.py, pausing 0.1 ms before each reply) read blocking and awaited on the loop:
what asyncio's own wait adds to a round trip, which the asyncio client cannot go below. Throughput: 64 coroutines on one
loop, each calling in a closed loop, against 64 threads of one ``Pool`` doing the same; rounds alternate, and the
median of each is compared. The threads the process holds while the 64 coroutines wait are counted too.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from threads import together

from resident_pool.protocol import recv_line

CALLERS = 64
TINY = {"x": 1}
THINK_S = 0.0001


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class _Floor:
    """bench/echo_floor.py, a plain JSON-lines echo over AF_UNIX that pauses THINK_S before each reply: a round trip
    with no pool at all, whose reply is not there yet when its client first looks (so it waits, as on a worker)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("echo_floor.py")), self.path,
                                        str(THINK_S)], stdout=subprocess.PIPE, text=True)
        assert self.server.stdout is not None and self.server.stdout.readline().strip() == "ready"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)
        self.buf = bytearray()
        self.line = json.dumps({"op": "predict", "id": 1, "payload": TINY}).encode() + b"\n"

    def call(self) -> None:
        self.sock.sendall(self.line)
        recv_line(self.sock, self.buf)

    async def acall(self) -> None:
        from resident_pool.aio import streams

        await streams.send(self.sock, self.line, None)
        await streams.recv_line(self.sock, self.buf, None)

    def close(self) -> None:
        self.sock.setblocking(True)
        self.sock.sendall(b'{"op": "shutdown"}\n')
        self.sock.close()
        self.server.wait(timeout=10)


def _latency(n: int, warmup: int, folder: Path) -> dict[str, list[float]]:
    """Four calls taken in turn, ``n`` samples each: Pool.predict, AsyncPool.predict, and the floor's round trip on
    a blocking socket and on a non-blocking one awaited on the loop (the asyncio client's own waits)."""
    from resident_pool import AsyncPool, Pool

    blocking, waiting = _Floor(folder / "floor-blocking.sock"), _Floor(folder / "floor-async.sock")
    waiting.sock.setblocking(False)

    async def run() -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {"sync": [], "async": [], "floor": [], "floor on the loop": []}
        async with AsyncPool() as apool:
            with Pool() as pool:
                for i in range(warmup + n):
                    marks = [time.perf_counter()]
                    pool.predict("echo", TINY)
                    marks.append(time.perf_counter())
                    await apool.predict("echo", TINY)
                    marks.append(time.perf_counter())
                    blocking.call()
                    marks.append(time.perf_counter())
                    await waiting.acall()
                    marks.append(time.perf_counter())
                    if i >= warmup:
                        for name, began, ended in zip(samples, marks, marks[1:], strict=False):
                            samples[name].append(ended - began)
        return samples

    try:
        return asyncio.run(run())
    finally:
        blocking.close()
        waiting.close()


def _coroutines(calls: int) -> tuple[float, int]:
    """Calls a second from CALLERS coroutines on one loop; and the most threads the process held meanwhile, over
    what it held before."""
    from resident_pool import AsyncPool

    async def run() -> tuple[float, int]:
        async with AsyncPool() as apool:
            await asyncio.gather(*(apool.predict("echo", TINY) for _ in range(CALLERS)))  # every lease acquired
            before, most, done = threading.active_count(), [0], asyncio.Event()

            async def count() -> None:
                while not done.is_set():
                    most[0] = max(most[0], threading.active_count())
                    await asyncio.sleep(0.005)

            async def caller(k: int) -> None:
                for n in range(calls):
                    payload = {"caller": k, "n": n}
                    answer = await apool.predict("echo", payload)
                    if answer["echo"] != payload:
                        raise AssertionError(f"caller {k} sent {payload} and was answered {answer}")

            counting = asyncio.create_task(count())
            started = time.perf_counter()
            await asyncio.gather(*(caller(k) for k in range(CALLERS)))
            elapsed = time.perf_counter() - started
            done.set()
            await counting
        return CALLERS * calls / elapsed, max(0, most[0] - before)

    return asyncio.run(run())


def _threads(calls: int) -> float:
    """Calls a second from CALLERS threads of one Pool (each thread keeps its own lease); a thread that raises
    fails the case (threads.together)."""
    from resident_pool import Pool

    with Pool() as pool:
        together([lambda: pool.predict("echo", TINY)] * CALLERS, timeout_s=300)

        def caller(k: int) -> None:
            for n in range(calls):
                payload = {"caller": k, "n": n}
                answer = pool.predict("echo", payload)
                if answer["echo"] != payload:
                    raise AssertionError(f"caller {k} sent {payload} and was answered {answer}")

        elapsed = together([lambda k=k: caller(k) for k in range(CALLERS)], timeout_s=600)
    return CALLERS * calls / elapsed


def case_async_client(table: Any, env: Any, quick: bool) -> None:
    n, warmup = (500, 100) if quick else (3000, 300)
    calls, rounds = (10, 2) if quick else (40, 3)
    samples = _latency(n, warmup, env.tmp)
    us = 1e6
    s50, a50 = _percentile(samples["sync"], 50), _percentile(samples["async"], 50)
    f50, l50 = _percentile(samples["floor"], 50), _percentile(samples["floor on the loop"], 50)
    case = "asyncio client (echo)"
    table.add(case, "Pool.predict p50", s50 * us, "us")
    table.add(case, "AsyncPool.predict p50", a50 * us, "us")
    table.add(case, "Pool.predict p99", _percentile(samples["sync"], 99) * us, "us")
    table.add(case, "AsyncPool.predict p99", _percentile(samples["async"], 99) * us, "us")
    # The loop's own cost: each wait is an epoll registration, a wake-up and two turns of the loop, and each layer a
    # coroutine; half a blocking call's cost again would be work of the client's own.
    table.add(case, "AsyncPool.predict p50 / Pool.predict p50", a50 / s50, "x", "<= 1.5", a50 / s50 <= 1.5, note=(
        f"taken in turn, {n} each: {a50 * us:.1f} us against {s50 * us:.1f} us"))
    table.add(case, "raw echo awaited on the loop / read blocking, p50", l50 / f50, "x", note=(
        f"bench/echo_floor.py (0.1 ms pause), no pool, in the same turns: {l50 * us:.1f} us against {f50 * us:.1f} us"))
    by_coroutines, by_threads, threads_added = [], [], 0
    for _ in range(rounds):  # alternated: a slow moment of the host falls on both
        rate, added = _coroutines(calls)
        by_coroutines.append(rate)
        threads_added = max(threads_added, added)
        by_threads.append(_threads(calls))
    coroutines, threads = statistics.median(by_coroutines), statistics.median(by_threads)
    table.add("asyncio client (echo)", f"{CALLERS} coroutines, one loop: calls/s", coroutines, "1/s")
    table.add("asyncio client (echo)", f"{CALLERS} threads of one Pool: calls/s", threads, "1/s")
    table.add("asyncio client (echo)", f"{CALLERS} coroutines / {CALLERS} threads, throughput", coroutines / threads,
              "x", ">= 1", coroutines / threads >= 1,
              note=f"closed loop, {calls} calls each, median of {rounds} alternated rounds; echo has 4 replicas")
    table.add("asyncio client (echo)", f"threads added while {CALLERS} coroutines wait", threads_added, "", "0",
              threads_added == 0)
