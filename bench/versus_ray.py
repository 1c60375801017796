"""The demo provider batching under the pool against Ray Serve's ``@serve.batch`` around the same model, in one run.

Ray Serve's side: one deployment whose replica loads the demo's own model and embedding function (the worker
script's ``load`` and ``embed``, as the in-process baselines do), with ``@serve.batch`` at our ``max_batch_size``
and ``batch_wait_timeout_s`` = our ``max_wait_ms`` / 1000, ``max_ongoing_requests`` at least 64 and torch's threads
as our worker's; called through a ``DeploymentHandle`` (no HTTP) on a local Ray of 2 CPUs. Ours: the provider's
``[batching]`` worker, called through ``AsyncPool``. Both sides' callers are coroutines of one loop, each sending
one sequence per call; every answer is compared with its own input's reference embedding (within 1e-4), so an
answer given to the wrong caller fails the case.

- closed loop: 64 callers, rounds alternated between the two, throughput compared;
- open loop: Poisson arrivals at 50% and 90% of Ray Serve's measured throughput, the same arrival times for both;
  latency from each arrival's own time (a late start counts against the side that was late);
- poison: 64 callers at once, one input poisoned; ours answers the 63 and fails the one, Ray Serve's batch of 64
  (held open until all 64 are in) fails them all.

Ray is shut down at the end, whatever happened, and every process it started is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CALLERS = 64
RESIDUES = 20  # one window each, as real_model's: a whole protein of data/ (median 360 residues) took 1.7 s alone
# on the loaded 2-core host, and 64 of 40 residues 6 to 11 s
TOLERANCE = 1e-4  # padding moves the last digits (1.6e-7 here) and the reply rounds to 5 (a step of 1e-5)
POISON = "1"  # not a residue letter: the demo's tokenizing refuses the input it is in
BATCHING_SLUG = "minilm-batching"

# The bench's own batch function for a demo worker that has none: every payload's inputs flattened into one call of
# the demo's embed (which sorts the windows by length), split back per payload. An input that cannot be read raises
# for the whole call, and the worker isolates it (docs/batching.md).
_FALLBACK_BATCH = '''
    def on_predict_batch(payloads):
        """The bench's stand-in (bench/versus_ray.py): the demo worker ships no batch function yet."""
        flat, counts = [], []
        for payload in payloads:
            inputs = payload.get("inputs") if isinstance(payload, dict) else None
            if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
                raise ValueError('payload must be {"inputs": [str, ...]}')
            if payload.get("kind", "protein") != "protein" or "encoding" in payload or not inputs:
                counts.append(None)
                continue
            flat += inputs
            counts.append(len(inputs))
        vectors, items = embed(model, flat) if flat else ([], [])
        answers, at = [], 0
        for payload, count in zip(payloads, counts, strict=True):
            if count is None:
                answers.append(on_predict(payload))
                continue
            mine = items[at:at + count]
            for item, vector in zip(mine, vectors[at:at + count], strict=True):
                item["embedding"] = [round(float(x), int(payload.get("digits", 5))) for x in vector]
            answers.append({"items": mine, "dim": int(vectors.shape[1]), "pid": os.getpid(), "device": device})
            at += count
        return answers

'''
SERVE_CALL = '    worker_base.serve(slug="minilm", socket_path=socket_path, on_predict=on_predict, ready=ready)'
_BATCHING_TABLE = "\n[batching]\nmax_batch_size = 64\nmax_callers = 64\nmax_wait_ms = 0\n"


def batching_minilm(manifests: Path) -> tuple[str, str]:
    """(slug, how): the demo provider when it ships ``[batching]`` and ``on_predict_batch``; else a copy of it
    beside it in the bench's own manifests folder (``minilm-batching``) with both added, so the case runs either
    way and the other cases keep the shipped one."""
    from resident_pool.providers.manifest import load_manifest

    folder = manifests / "minilm"
    script = (folder / "worker.py").read_text()
    if load_manifest(folder / "manifest.toml").batching is not None and "on_predict_batch" in script:
        return "minilm", "the shipped demo provider's [batching] and on_predict_batch"
    copy = manifests / BATCHING_SLUG
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    text = (folder / "manifest.toml").read_text().replace('slug = "minilm"', f'slug = "{BATCHING_SLUG}"', 1)
    if "[batching]" not in text:
        text += _BATCHING_TABLE
    if "on_predict_batch" not in script:
        if SERVE_CALL not in script:
            raise RuntimeError("manifests/minilm/worker.py has no on_predict_batch and its serve() call is not the one "
                               "the bench knows how to replace: update bench/versus_ray.py")
        batched = SERVE_CALL.replace('slug="minilm"', f'slug="{BATCHING_SLUG}"')
        script = script.replace(SERVE_CALL, _FALLBACK_BATCH + batched.replace("on_predict=on_predict",
                                                                              "on_predict_batch=on_predict_batch"))
    (copy / "manifest.toml").write_text(text)
    (copy / "worker.py").write_text(script)
    return BATCHING_SLUG, ("a temporary copy of minilm with [batching] and the bench's own on_predict_batch (the "
                           "shipped demo lacks them)")


def texts(n: int) -> list[str]:
    """``n`` distinct sequences of data/, cut to RESIDUES (each is its caller's own: answers are matched to them)."""
    from run import sequences

    seen: dict[str, None] = {}
    for text in sequences(500, residues=RESIDUES):
        seen.setdefault(text)
    found = list(seen)
    if len(found) < n:
        raise RuntimeError(f"data/ holds {len(found)} distinct sequences of {RESIDUES} residues, not {n}")
    return found[:n]


def check(vector: Any, reference: Any, what: str) -> None:
    import numpy

    got = numpy.asarray(vector, dtype=numpy.float64)
    if got.shape != reference.shape:
        raise AssertionError(f"{what}: an answer of shape {got.shape}, not {reference.shape}")
    off = float(numpy.max(numpy.abs(got - reference)))
    if not off <= TOLERANCE:
        raise AssertionError(f"{what}: its answer is {off:.3g} from its own input's reference (tolerance {TOLERANCE})")


def ours_vector(answer: Any) -> Any:
    """The one embedding of a one-input answer, whichever way the provider carried it."""
    if isinstance(answer, dict) and "embeddings" in answer:
        return answer["embeddings"][0]
    return answer["items"][0]["embedding"]


# -- Ray Serve ----------------------------------------------------------------------------------------------------
def _ray_deployment(serve: Any, max_batch_size: int, wait_s: float, ongoing: int) -> Any:
    """The deployment class: defined here, so Ray pickles it by value (bench/ is no package its workers import)."""

    @serve.deployment(max_ongoing_requests=ongoing, ray_actor_options={"num_cpus": 1})
    class DemoEmbedding:
        def __init__(self, script: str, weights_root: str, threads: int) -> None:
            import importlib.util

            import torch

            torch.set_num_threads(threads)  # Ray gives a worker 1 (OMP_NUM_THREADS); ours has torch's default
            spec = importlib.util.spec_from_file_location("minilm_worker", script)
            worker = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(worker)
            self.model, self.embed = worker.load(weights_root), worker.embed
            self.embed(self.model, ["MKV"])  # the first pass allocates, as the worker's does before it is ready

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def __call__(self, sequences: list[str]) -> list[Any]:
            vectors, _ = self.embed(self.model, sequences)
            return list(vectors)

        def hold_batches(self, wait_s: float) -> None:
            self.__call__.set_batch_wait_timeout_s(wait_s)

    return DemoEmbedding


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` have used (those gone count 0)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LocalRay:
    """A local Ray of ``num_cpus`` in its own temp folder, Serve without its HTTP proxy; ``close`` shuts both down
    and waits for every process the start made (SIGKILL for any still running 30 s later), whatever happened."""

    def __init__(self, folder: Path, num_cpus: int = 2) -> None:
        import ray
        from ray import serve

        self.ray, self.serve = ray, serve
        self.own: list[int] = []
        before = set(_descendants(os.getpid()))
        try:
            # address="local": a new cluster of our own, never one another job on this host started.
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, object_store_memory=200 * 2**20, _temp_dir=str(folder))
            serve.start(proxy_location="Disabled")
        finally:
            self.own = [pid for pid in _descendants(os.getpid()) if pid not in before]

    def deploy(self, deployment: Any, *args: Any) -> Any:
        handle = self.serve.run(deployment.bind(*args), name="versus-ray", route_prefix=None)
        self.own = sorted(set(self.own) | set(_descendants(os.getpid())))
        return handle

    def close(self) -> int:
        """Shut Ray down; returns how many of its processes had to be killed."""
        self.own = sorted(set(self.own) | {pid for pid in _descendants(os.getpid()) if "ray" in _cmdline(pid)})
        try:
            with contextlib.suppress(Exception):  # a Serve that never started: Ray itself is still shut down
                self.serve.shutdown()
        finally:
            self.ray.shutdown()
        deadline, killed = time.monotonic() + 30, 0
        while any(_alive(pid) for pid in self.own) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.own:
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
        for pid in self.own:  # our own children: waited for, so none stays a zombie
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        return killed


def say(text: str) -> None:
    """A line on how far the case has come (its rows come at its end)."""
    print(f"  versus_ray: {text}", flush=True)


# -- the loads --------------------------------------------------------------------------------------------------------
async def closed_loop(call: Any, inputs: list[str], refs: list[Any], per_caller: int, what: str) -> float:
    """Items a second from one caller per input, each calling ``per_caller`` times in a row, answers checked."""

    async def caller(k: int) -> None:
        for n in range(per_caller):
            check(await call(inputs[k]), refs[k], f"{what}: caller {k}, call {n}")

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(caller(k) for k in range(len(inputs)))), timeout=600)
    return len(inputs) * per_caller / (time.perf_counter() - started)


def arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Poisson arrival times (s from the start) of ``n`` requests at ``rate`` a second."""
    chance, at, times = random.Random(seed), 0.0, []
    for _ in range(n):
        at += chance.expovariate(rate)
        times.append(at)
    return times


async def open_loop(call: Any, inputs: list[str], refs: list[Any], times: list[float], what: str) -> list[float]:
    """Each request sent at its arrival time whatever is still in flight; its latency from that time."""
    latencies: list[float] = []

    async def one(k: int, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        check(await call(inputs[k % len(inputs)]), refs[k % len(refs)], f"{what}: arrival {k}")
        latencies.append(time.perf_counter() - due)

    start = time.perf_counter() + 0.05
    await asyncio.wait_for(asyncio.gather(*(one(k, start + at) for k, at in enumerate(times))),
                           timeout=times[-1] + 600)
    return latencies


async def poisoned(call: Any, inputs: list[str], refs: list[Any], bad: int, what: str) -> tuple[int, list[str]]:
    """64 at once, input ``bad`` poisoned: (answers, each failure's words); every answer checked against its own."""
    sent = [text if k != bad else text[:10] + POISON + text[10:] for k, text in enumerate(inputs)]
    got = await asyncio.wait_for(asyncio.gather(*(call(text) for text in sent), return_exceptions=True), timeout=600)
    answers, failures = 0, []
    for k, answer in enumerate(got):
        if isinstance(answer, BaseException):
            if not isinstance(answer, Exception):
                raise answer
            failures.append(f"{type(answer).__name__}: {answer}")
        else:
            if k == bad:
                raise AssertionError(f"{what}: the poisoned input was answered {answer!r}")
            check(answer, refs[k], f"{what}: caller {k}")
            answers += 1
    return answers, failures


def _model_calls(metrics: str, slug: str) -> tuple[float, float]:
    """(model calls, requests they took) of ``slug``'s batching workers so far (every replica), from the pool's
    metrics."""
    found = {}
    for name in ("count", "sum"):
        pattern = rf'^resident_pool_batch_size_{name}\{{[^}}]*provider="{re.escape(slug)}"[^}}]*\}} (\S+)$'
        found[name] = sum(float(value) for value in re.findall(pattern, metrics, re.MULTILINE))
    return found["count"], found["sum"]


async def settled_calls(apool: Any, slug: str, since: tuple[float, float], items: int) -> tuple[float, float]:
    """(model calls, requests) of ``slug`` since ``since``, once the pool's metrics count at least ``items`` more
    requests: it asks a worker with kept leases for its counts every few seconds, not after each request."""
    deadline = time.monotonic() + 20
    while True:
        calls, taken = _model_calls(await apool.metrics_text(), slug)
        if taken - since[1] >= items or time.monotonic() > deadline:
            return calls - since[0], taken - since[1]
        await asyncio.sleep(0.5)


# -- the case ---------------------------------------------------------------------------------------------------------
def case_versus_ray(table: Any, env: Any, quick: bool) -> None:
    from run import RAY_MISSING, minilm_embed, percentile

    case = "batching vs Ray Serve"
    try:
        from ray import serve  # present or not, said in the table
    except ImportError:
        for measure, target in (("closed loop: ours / Ray Serve throughput", ">= 1.2"),
                                ("open loop 50%: p50 ours / Ray Serve", "<= 0.8"),
                                ("open loop 90%: p50 ours / Ray Serve", "<= 0.8"),
                                ("poison: answers ours / Ray Serve", "63 / 0")):
            table.unmeasured(case, measure, target, RAY_MISSING.replace("Ray", "Ray Serve"))
        return
    from resident_pool import AsyncPool
    from resident_pool.providers.launch import weights_root
    from resident_pool.providers.manifest import load_manifest

    slug, how = batching_minilm(env.manifests)
    limits = load_manifest(env.manifests / slug / "manifest.toml").batching
    max_batch_size, wait_s = limits.max_batch_size, limits.max_wait_ms / 1000
    ongoing = max(CALLERS, limits.callers)
    inputs = texts(CALLERS)
    model, embed = minilm_embed(env.manifests)
    vectors, _ = embed(model, inputs)  # the references: each input's own embedding
    refs = [vector.astype("float64") for vector in vectors]
    import torch

    threads = torch.get_num_threads()  # what a fresh worker process of ours gets too (nothing here changed it)
    del model
    per_caller, rounds = (1, 2) if quick else (1, 6)
    open_seconds, open_least, open_most = (6.0, 60, 600) if quick else (20.0, 160, 3000)
    figures: dict[str, Any] = {}
    ray_folder = Path(env.tmp) / "ray"
    started = time.perf_counter()
    local = LocalRay(ray_folder)
    killed = None
    try:
        handle = local.deploy(_ray_deployment(serve, max_batch_size, wait_s, ongoing),
                              str(env.manifests / "minilm" / "worker.py"),
                              str(weights_root(load_manifest(env.manifests / "minilm" / "manifest.toml"))), threads)
        figures = asyncio.run(_measure(AsyncPool, slug, handle, inputs, refs, per_caller, rounds, open_seconds,
                                       open_least, open_most, local.own))
    finally:
        killed = local.close()
        shutil.rmtree(ray_folder, ignore_errors=True)
    took = time.perf_counter() - started

    setup = (f"{how}; max_batch_size {max_batch_size}, max_wait_ms {limits.max_wait_ms:g} (Ray Serve: "
             f"batch_wait_timeout_s {wait_s:g}, max_ongoing_requests {ongoing}); {CALLERS} sequences of data/, "
             f"{RESIDUES} residues each; torch threads {threads} on both")
    ours_rate, ray_rate = figures["closed"]["ours"], figures["closed"]["ray"]
    table.add(case, f"closed loop, {CALLERS} callers: ours", ours_rate, "items/s",
              note=f"{figures['closed']['per_call']:.1f} requests per model call on average; {setup}")
    ratios = figures["closed"]["ratios"]
    table.add(case, f"closed loop, {CALLERS} callers: Ray Serve", ray_rate, "items/s",
              note=f"{rounds} rounds alternated with ours, {per_caller} call(s) per caller each; ours / Ray Serve "
                   f"by round from {ratios[0]:.2f}x to {ratios[-1]:.2f}x")
    table.add(case, "closed loop: ours / Ray Serve throughput", ours_rate / ray_rate, "x", ">= 1.2",
              ours_rate / ray_rate >= 1.2)
    cpu = figures["closed"]["cpu"]
    table.add(case, "closed loop: CPU per answer, ours / Ray Serve", cpu["ours"] / cpu["ray"], "x", note=(
        f"each side's whole stack while it ran (the callers' process; our pool and worker; Ray's raylet, GCS, "
        f"controller and replica): {cpu['ours'] * 1e3:.1f} ms against {cpu['ray'] * 1e3:.1f} ms per answer. On a "
        "host shared with other work the throughput follows the CPU each model process is given"))
    ms = 1e3
    for share in (50, 90):
        found = figures["open"][share]
        ours, theirs = found["ours"], found["ray"]
        o50, r50, o99, r99 = (percentile(ours, 50), percentile(theirs, 50), percentile(ours, 99),
                              percentile(theirs, 99))
        said = (f"{len(ours)} Poisson arrivals at {found['rate']:.2f}/s ({share}% of Ray Serve's throughput), the same "
                f"times for both, in two halves taken ours-Ray, Ray-ours; p50 {o50 * ms:.0f} ms against "
                f"{r50 * ms:.0f} ms, p99 {o99 * ms:.0f} ms against {r99 * ms:.0f} ms")
        table.add(case, f"open loop {share}%: p50 ours / Ray Serve", o50 / r50, "x", "<= 0.8", o50 / r50 <= 0.8,
                  note=said)
        table.add(case, f"open loop {share}%: p99 ours / Ray Serve", o99 / r99, "x", "<= 1", o99 / r99 <= 1)
    poison = figures["poison"]
    ours_ok, ours_failed = poison["ours"]
    ray_ok, ray_failed = poison["ray"]
    clear = len(ours_failed) == 1 and POISON in ours_failed[0] and "residue" in ours_failed[0]
    met = ours_ok == CALLERS - 1 and clear and ray_ok == 0 and len(ray_failed) == CALLERS
    table.add(case, f"poison, {CALLERS} callers, 1 bad input: ours answered", ours_ok, "",
              f"{CALLERS - 1} answered, 1 error", ours_ok == CALLERS - 1 and clear,
              note=(f"ours: {ours_ok} answers, {len(ours_failed)} error(s) "
                    f"({poison['ours_calls']}); its error: {ours_failed[0][:200] if ours_failed else '-'}"))
    table.add(case, f"poison, {CALLERS} callers, 1 bad input: Ray Serve answered", ray_ok, "",
              f"0 answered, {CALLERS} errors", ray_ok == 0 and len(ray_failed) == CALLERS,
              note=(f"Ray Serve: {ray_ok} answers, {len(ray_failed)} errors (its batch held open until the "
                    f"{CALLERS} were in); the first: {ray_failed[0][:160] if ray_failed else '-'}"))
    table.add(case, "poison: ours answered / Ray Serve answered", ours_ok, "", f"{CALLERS - 1} vs 0", met,
              note=f"ours {ours_ok} answers + {len(ours_failed)} error; Ray Serve {ray_ok} answers + "
                   f"{len(ray_failed)} errors")
    table.add(case, f"poisoned {CALLERS} / clean {CALLERS}, ours: time", poison["ratio"], "x", "",
              None, note=f"median of {poison['tries']}: {poison['bad_s'] * ms:.0f} ms against "
                         f"{poison['clean_s'] * ms:.0f} ms")
    table.add(case, "the case's wall time (Ray start to shutdown)", took, "s",
              note=f"Ray shut down; {killed} of its processes had to be killed after 30 s")


async def _measure(AsyncPool: Any, slug: str, handle: Any, inputs: list[str], refs: list[Any], per_caller: int,
                   rounds: int, open_seconds: float, open_least: int, open_most: int,
                   ray_pids: list[int]) -> dict[str, Any]:
    """Every measurement, on one loop (the AsyncPool's kept leases live as long as it)."""
    async with AsyncPool() as apool:

        async def ours(text: str) -> Any:
            return ours_vector(await apool.predict(slug, {"inputs": [text]}))

        async def theirs(text: str) -> Any:
            return await handle.remote(text)

        sides = {"ours": ours, "ray": theirs}
        for name, call in sides.items():  # warm: every lease taken, the replica's first batches run
            await closed_loop(call, inputs, refs, 1, f"{name} warm-up")
        rates: dict[str, list[float]] = {"ours": [], "ray": []}
        total = len(inputs) * per_caller * rounds
        before = await settled_calls(apool, slug, (0.0, 0.0), 2 * len(inputs))
        status = await apool.status()
        # Each side's whole stack, this process (its callers) included: the CPU it spends per answer.
        stacks = {"ours": [os.getpid(), status["pool"]["pid"], *(worker["pid"] for worker in status["workers"]
                                                                  if worker["slug"] == slug)],
                  "ray": [os.getpid(), *ray_pids]}
        elapsed, spent = {"ours": 0.0, "ray": 0.0}, {"ours": 0.0, "ray": 0.0}
        for turn in range(rounds):  # alternated, each first in turn: a busy moment of the host falls on both
            for name in ("ours", "ray") if turn % 2 == 0 else ("ray", "ours"):
                began, used = time.perf_counter(), cpu_s(stacks[name])
                rates[name].append(await closed_loop(sides[name], inputs, refs, per_caller, f"{name} closed loop"))
                elapsed[name] += time.perf_counter() - began
                spent[name] += cpu_s(stacks[name]) - used
            say(f"closed loop round {turn + 1}/{rounds}: ours {rates['ours'][-1]:.1f}/s, Ray Serve "
                f"{rates['ray'][-1]:.1f}/s")
        calls, items = await settled_calls(apool, slug, before, total)
        closed: dict[str, Any] = {name: total / elapsed[name] for name in sides}
        closed["per_call"] = items / max(1.0, calls)
        closed["cpu"] = {name: spent[name] / total for name in sides}
        closed["ratios"] = sorted(mine / theirs for mine, theirs in zip(rates["ours"], rates["ray"], strict=True))
        opened: dict[int, dict[str, Any]] = {}
        for share in (50, 90):
            rate = closed["ray"] * share / 100
            n = max(open_least, min(open_most, round(rate * open_seconds)))
            opened[share] = {"rate": rate, "ours": [], "ray": []}
            # Two halves, ours then Ray's then Ray's then ours (each half its own arrival times, the same for both
            # sides): a host whose load drifts during the run weighs on both alike.
            for half, order in enumerate((("ours", "ray"), ("ray", "ours"))):
                times = arrivals(rate, n // 2, seed=share * 10 + half)
                for name in order:
                    opened[share][name] += await open_loop(sides[name], inputs, refs, times,
                                                           f"{name} open loop {share}%")
                    say(f"open loop {share}%, half {half + 1}: {name} done ({len(times)} arrivals at {rate:.2f}/s)")
        bad = CALLERS // 2
        clean_s, bad_s = [], []
        tries = 3
        before = await settled_calls(apool, slug, (0.0, 0.0), 0)
        for _ in range(tries):
            began = time.perf_counter()
            await closed_loop(ours, inputs, refs, 1, "ours clean 64")
            clean_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            ours_poison = await poisoned(ours, inputs, refs, bad, "ours poisoned")
            bad_s.append(time.perf_counter() - began)
        calls, _ = await settled_calls(apool, slug, before, 2 * len(inputs) * tries)
        await handle.hold_batches.remote(60.0)  # the 64 in one batch: it closes when the 64th is in
        ray_poison = await poisoned(theirs, inputs, refs, bad, "Ray Serve poisoned")
    clean, dirty = statistics.median(clean_s), statistics.median(bad_s)
    return {"closed": closed, "open": opened,
            "poison": {"ours": ours_poison, "ray": ray_poison, "tries": tries, "clean_s": clean, "bad_s": dirty,
                       "ratio": dirty / clean,
                       "ours_calls": f"{calls / tries:.1f} model calls per clean + poisoned "
                                     "pair of 64"}}


if __name__ == "__main__":
    sys.exit("run it as: python bench/run.py --only versus_ray")
