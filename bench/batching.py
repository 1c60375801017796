"""Batching at the worker (``serve(on_predict_batch=...)``), measured over raw connections, without a pool.

One purpose-built model (tests/workers/batchworker.py) whose call costs a fixed overhead plus a little per input,
as a GPU's does: 64 closed-loop callers of one item each against a batching worker, against one client sending
the 64 items as one request (the ceiling: one model call per 64 items and one round trip), and against the same
model served one request per call; and a lone caller of a free model, batching against serial (what the batching
path costs a caller alone). Every answer is checked against its own input: a wrong one fails the case.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH_WORKER = ROOT / "tests" / "workers" / "batchworker.py"
CALLERS = 64
COST_MS, PER_ITEM_MS = 10.0, 0.1  # one call of 64 items costs 16.4 ms, one of 1 item 10.1 ms
WAIT_MS = 5.0  # long enough for 64 callers answered together to have asked again


class _Worker:
    """A batching test worker started by hand; its own connections for the callers."""

    def __init__(self, folder: str, name: str, *options: str, **env: str) -> None:
        from resident_pool.providers.supervisor import PROTOCOL_PATH, WORKER_BASE_PATH

        self.socket = os.path.join(folder, f"{name}.sock")
        env = {**os.environ, "RESIDENT_POOL_PROTOCOL": PROTOCOL_PATH, "RESIDENT_POOL_WORKER_BASE": WORKER_BASE_PATH,
               **env}
        self.proc = subprocess.Popen([sys.executable, str(BATCH_WORKER), self.socket, *options], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bench's {name} worker did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def _answers(self) -> bool:
        from resident_pool.protocol import connect, recv_line, send_line

        try:
            with connect(self.socket, timeout=1) as conn:
                send_line(conn, {"op": "ping", "id": 0})
                return bool(recv_line(conn, bytearray())["ok"])
        except OSError:
            return False

    def caller(self):
        """A call function on a connection of its own: ``call(tag, count=1)`` returns the checked result."""
        from resident_pool.protocol import connect, recv_line, send_line

        conn = connect(self.socket)
        conn.settimeout(120)
        buf = bytearray()

        def call(tag: int, count: int = 1) -> dict:
            send_line(conn, {"op": "predict", "id": tag, "payload": {"tag": tag, "count": count}})
            reply = recv_line(conn, buf)
            if not reply or not reply.get("ok") or reply["result"]["tag"] != tag:
                raise AssertionError(f"request {tag} was answered {reply!r}")
            return reply

        call.close = conn.close
        return call

    def stats(self) -> dict:
        from resident_pool.protocol import connect, recv_line, send_line

        with connect(self.socket) as conn:
            send_line(conn, {"op": "stats", "id": 0})
            return recv_line(conn, bytearray())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _closed_loop(worker: _Worker, rounds: int) -> float:
    """Items per second from ``CALLERS`` callers each sending ``rounds`` one-item requests, one after another.

    The callers are coroutines of one asyncio loop, each on a connection of its own, as an async client's are:
    64 threads would spend more of each round handing the GIL around than the model takes."""
    return asyncio.run(_callers(worker.socket, rounds))


def _closed_loop_sized(worker: _Worker, rounds: int) -> tuple[float, float]:
    """``_closed_loop``'s items per second, and how many items the worker's calls took on average meanwhile."""
    before = worker.stats()["batches"]
    rate = _closed_loop(worker, rounds)
    after = worker.stats()["batches"]
    return rate, (after["items"] - before["items"]) / max(1, after["calls"] - before["calls"])


async def _callers(path: str, rounds: int) -> float:
    ready, go = 0, asyncio.Event()

    async def stream(n: int) -> None:
        nonlocal ready
        reader, writer = await asyncio.open_unix_connection(path, limit=2**20)
        try:
            for r in range(-1, rounds):  # -1: connected and warm before the clock starts
                if r == 0:
                    ready += 1
                    await go.wait()
                tag = n * rounds + r
                writer.write(json.dumps({"op": "predict", "id": tag, "payload": {"tag": tag}}).encode() + b"\n")
                reply = json.loads(await reader.readline())
                if not reply.get("ok") or reply["result"]["tag"] != tag:
                    raise AssertionError(f"request {tag} was answered {reply!r}")
        finally:
            writer.close()
            await writer.wait_closed()

    tasks = [asyncio.create_task(stream(n)) for n in range(CALLERS)]
    while ready < CALLERS:
        if any(task.done() for task in tasks):
            break  # one failed before the clock: gather says why
        await asyncio.sleep(0.001)
    started = time.perf_counter()
    go.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
    return CALLERS * rounds / (time.perf_counter() - started)


def _lone(first: _Worker, second: _Worker, n: int) -> tuple[float, float]:
    """p50 of one caller's requests to each worker, taken in turn (a busy moment falls on both alike)."""
    from run import percentile, timed_together

    one, other = first.caller(), second.caller()
    ids = iter(range(10**9))
    try:
        samples = timed_together({"first": lambda: one(next(ids)), "second": lambda: other(next(ids))}, n,
                                 warmup=min(200, n))
    finally:
        one.close()
        other.close()
    return percentile(samples["first"], 50), percentile(samples["second"], 50)


def case_worker_batching(table, env, quick: bool) -> None:
    rounds = 10 if quick else 40
    folder = tempfile.mkdtemp(prefix="rp-bb-")  # short: AF_UNIX paths
    cost = ["--cost-ms", f"{COST_MS:g}", "--per-item-ms", f"{PER_ITEM_MS:g}"]
    case = "worker batching"
    try:
        with ExitStack() as stack:
            def start(name: str, *options: str, **env: str) -> _Worker:
                worker = _Worker(folder, name, *options, **env)
                stack.callback(worker.close)
                return worker

            batching, serial = start("batching", *cost), start("serial", "--serial", *cost)
            waiting = start("waiting", *cost, RESIDENT_POOL_MAX_WAIT_MS=f"{WAIT_MS:g}")
            batched, per_call = _closed_loop_sized(batching, rounds)
            held, per_held_call = _closed_loop_sized(waiting, rounds)
            one = batching.caller()
            started = time.perf_counter()
            for r in range(rounds):
                one(r, CALLERS)
            single = CALLERS * rounds / (time.perf_counter() - started)
            one.close()
            one_by_one = _closed_loop(serial, max(1, rounds // 10))
            lone_model, lone_model_serial = _lone(batching, serial, 50 if quick else 200)
            echo, echo_serial = start("echo"), start("echo-serial", "--serial")
            lone_free, lone_free_serial = _lone(echo, echo_serial, 500 if quick else 3000)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    model = f"model call {COST_MS:g} ms + {PER_ITEM_MS:g} ms per item"
    table.add(case, f"{CALLERS} callers, batching", batched, "items/s",
              note=f"{model}; {per_call:.1f} items per call on average")
    table.add(case, f"{CALLERS} callers, batching, max_wait_ms {WAIT_MS:g}", held, "items/s",
              note=f"{model}; {per_held_call:.1f} items per call on average")
    table.add(case, f"one client, {CALLERS} items per request", single, "items/s", note=model)
    table.add(case, f"{CALLERS} callers, one request per call", one_by_one, "items/s", note=model)
    # The 0.9x is the demo provider's, whose cost is per input; a fixed 10 ms a call is the worst case for
    # max_wait_ms 0, where 64 callers answered together come back in two calls' worth.
    table.add(case, f"{CALLERS} callers batching / one client of {CALLERS}", batched / single, "x",
              note="max_wait_ms 0: a call starts with whatever has come")
    table.add(case, f"same, max_wait_ms {WAIT_MS:g} / one client of {CALLERS}", held / single, "x",
              note="held open until the 64 have asked again")
    table.add(case, f"{CALLERS} callers batching / one request per call", batched / one_by_one, "x", ">= 2",
              batched / one_by_one >= 2)
    table.add(case, "lone caller p50, batching / serial", lone_model / lone_model_serial, "x", "<= 1.05",
              lone_model / lone_model_serial <= 1.05,
              note=f"{model}; taken in turn: {lone_model * 1e3:.2f} ms against {lone_model_serial * 1e3:.2f} ms")
    table.add(case, "lone caller p50, batching - serial (free model)", (lone_free - lone_free_serial) * 1e6, "us",
              note=f"what the batching path costs a call: {lone_free * 1e6:.1f} us against "
                   f"{lone_free_serial * 1e6:.1f} us, taken in turn")
