"""The demo provider (manifests/minilm) as a batching provider, through a real pool, on sequences from data/.

Beside it in the same run, ``minilm-serial``: a copy of its manifest without ``[batching]``, so its worker answers
one request per model call and its replica carries one caller at a time (today's serving). Every answer is checked
against its own input: each caller's sequence has a reference embedding (the one-client request of all of them),
and an answer further from it than ``TOLERANCE`` (padding moves the last digits), or of another length, fails the
case. An exception in any caller fails the case.

- throughput: ``CALLERS`` closed-loop callers (coroutines of one ``AsyncPool``, each a lease of its own), one
  sequence a request, against one client sending the same sequences as one request, and against the serial copy;
- a lone caller: p50 of one sequence a request, batching against serial, taken in turn;
- mixed: a campaign's chunk streams hold the one replica while an interactive caller asks for one sequence now and
  then; its p95 against one chunk's compute time plus one batch's (the interactive request's own call);
- per-item failure: ``CALLERS`` callers at once, one of them poisoned, against the same burst unpoisoned: an input
  refused before the model runs (a letter that is no residue), and one that fails inside the model (a copy whose
  model raises on a marked window, so the worker splits the call to find it).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path
from typing import Any

CALLERS = 64
TOLERANCE = 1e-4  # the answers round nothing (arrays); padding moves the last digits (1.6e-7 seen here)
# A sequence no protein of data/ is: 77 tryptophans, one window of its own. The poisoned copy's model raises on it.
POISON = "W" * 77
POISON_LINE = "            longest = max(len(tokens) for _, tokens in batch)\n"
POISON_CHECK = ("            if any(len(tokens) == 79 and len(set(tokens[1:-1])) == 1 for _, tokens in batch):\n"
                "                raise RuntimeError('a poisoned window reached the model')\n")


def _providers(manifests: Path) -> None:
    """``minilm-serial`` (no [batching]) and ``minilm-poison`` (a model that raises on ``POISON``) beside the demo,
    written once a run (written again, the pool would see a new version of each and drain its worker)."""
    import shutil

    source = manifests / "minilm"
    text = (source / "manifest.toml").read_text()
    if "[batching]" not in text:
        raise RuntimeError("manifests/minilm has no [batching] table: this case measures the batching demo")
    head, _, tail = text.partition("[batching]")
    rest = tail.split("\n[", 1)
    serial = head + ("[" + rest[1] if len(rest) > 1 else "")
    script = (source / "worker.py").read_text()
    if script.count(POISON_LINE) != 1:
        raise RuntimeError("manifests/minilm/worker.py changed: the poisoned copy's hook line is not found once")
    for slug, toml, worker in (("minilm-serial", serial, script),
                               ("minilm-poison", text, script.replace(POISON_LINE, POISON_LINE + POISON_CHECK))):
        folder = manifests / slug
        manifest = toml.replace('slug = "minilm"', f'slug = "{slug}"')
        if (folder / "manifest.toml").is_file() and (folder / "manifest.toml").read_text() == manifest:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(source, folder)
        (folder / "manifest.toml").write_text(manifest)
        (folder / "worker.py").write_text(worker)


def _payload(texts: list[str]) -> dict[str, Any]:
    return {"inputs": texts, "encoding": "array"}


class _Reference:
    """Each sequence's embedding, as one client's request of all of them answered it; ``check`` holds an answer to
    its own input."""

    def __init__(self, texts: list[str], answer: dict[str, Any]) -> None:
        self.vectors: dict[str, Any] = {}
        self.add(texts, answer)

    def add(self, texts: list[str], answer: dict[str, Any]) -> None:
        for text, vector in zip(texts, answer["embeddings"], strict=True):
            self.vectors.setdefault(text, vector)

    def check(self, texts: list[str], answer: Any) -> None:
        import numpy

        embeddings = answer["embeddings"] if isinstance(answer, dict) else None
        if not isinstance(embeddings, numpy.ndarray) or embeddings.shape != (len(texts), 384):
            raise AssertionError(f"{len(texts)} sequences were answered {answer!r:.300}")
        for text, vector, item in zip(texts, embeddings, answer["items"], strict=True):
            gap = float(abs(vector - self.vectors[text]).max())
            if gap > TOLERANCE or item["tokens"] != len(text):
                raise AssertionError(f"a sequence of {len(text)} residues was answered {gap:.2g} away from its own "
                                     f"embedding ({item['tokens']} tokens): another input's answer")


async def _closed_loop(pool: Any, slug: str, texts: list[str], seconds: float, reference: _Reference,
                       shared: bool) -> float:
    """Sequences a second from one coroutine per sequence, each asking again as soon as it is answered, over
    ``seconds``: the answers that came in time over the time. Each caller's first request (its lease acquired, the
    worker warm) is made before the clock starts where the replica takes them all (``shared``); where it takes one,
    the callers take it in turn from the start, as they would."""
    ready, go, answered = [0], asyncio.Event(), [0]
    deadline = [0.0]

    async def caller(text: str) -> None:
        if shared:
            reference.check([text], await pool.predict(slug, _payload([text])))
        ready[0] += 1
        await go.wait()
        while time.perf_counter() < deadline[0]:
            reference.check([text], await pool.predict(slug, _payload([text])))
            if time.perf_counter() <= deadline[0]:
                answered[0] += 1

    tasks = [asyncio.create_task(caller(text)) for text in texts]
    while ready[0] < len(texts) and not any(task.done() for task in tasks):
        await asyncio.sleep(0.005)
    started = time.perf_counter()
    deadline[0] = started + seconds
    go.set()
    # Past the deadline a caller still waiting for its turn at a one-caller replica would wait for every other's:
    # those not done a moment after it are cancelled (a waiting one leaves the line; docs/asyncio.md). A shared
    # replica answers every caller's last request in a call or two.
    done, late = await asyncio.wait(tasks, timeout=seconds + (120.0 if shared else 1.0))
    for task in late:
        task.cancel()
    for outcome in [*(task.exception() for task in done), *await asyncio.gather(*late, return_exceptions=True)]:
        if outcome is not None and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
    return answered[0] / seconds


async def _burst(pool: Any, slug: str, texts: list[str], reference: _Reference, poisoned: int | None,
                 poison: str) -> tuple[float, list[str]]:
    """Every sequence asked for at once, one caller each (``poisoned``: that caller sends ``poison`` instead);
    the time until all are answered, and the errors."""
    from resident_pool.errors import ResidentPoolError

    errors: list[str] = []

    async def caller(n: int, text: str) -> None:
        if n != poisoned:
            reference.check([text], await pool.predict(slug, _payload([text])))
            return
        try:
            answer = await pool.predict(slug, _payload([poison]))
        except ResidentPoolError as error:
            errors.append(str(error))
        else:
            raise AssertionError(f"the poisoned input was answered {answer!r:.200}")

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(caller(n, text) for n, text in enumerate(texts))), timeout=600)
    return time.perf_counter() - started, errors


def _mixed(slug: str, chunks: list[list[str]], streams: int, arrivals: list[float], probe: str,
           reference: _Reference) -> dict[str, Any]:
    """``streams`` campaign streams (priority batch, a session each, as a campaign's chunk tasks) sending
    ``chunks`` between them, and an interactive caller (its lease kept, as a notebook's is) asking for ``probe`` at
    each of ``arrivals`` (seconds from the start); the interactive waits, and each chunk's time."""
    from threads import together

    from resident_pool import Pool

    lock = threading.Lock()
    queue = list(chunks)
    waits: list[float] = []
    chunk_times: list[float] = []
    ends: list[float] = []

    def stream() -> None:
        with Pool() as pool, pool.session(slug, priority="batch") as session:
            while True:
                with lock:
                    if not queue:
                        return
                    chunk = queue.pop()
                began = time.perf_counter()
                reference.check(chunk, session.predict(_payload(chunk)))
                with lock:
                    chunk_times.append(time.perf_counter() - began)
                    ends.append(time.perf_counter() - started)

    interactive_pool = Pool()
    reference.check([probe], interactive_pool.predict(slug, _payload([probe]), priority="interactive"))  # its lease

    def interactive() -> None:
        with interactive_pool as pool:
            for at in arrivals:
                time.sleep(max(0.0, at - (time.perf_counter() - started)))
                began = time.perf_counter()
                reference.check([probe], pool.predict(slug, _payload([probe]), priority="interactive"))
                waits.append(time.perf_counter() - began)

    started = time.perf_counter()
    together([stream] * streams + [interactive])
    return {"waits": waits, "chunks": chunk_times, "makespan": max(ends)}


def _texts() -> list[str]:
    """``CALLERS`` distinct sequences of data/ (a repeat would let a mixed-up answer pass for its own), cut to
    ``RESIDUES``."""
    from run import sequences

    texts = list(dict.fromkeys(sequences(4 * CALLERS, residues=RESIDUES)))[:CALLERS]
    if len(texts) != CALLERS:
        raise RuntimeError(f"data/ holds {len(texts)} distinct sequences, not {CALLERS}")
    return texts


def _timed(call: Any) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def case_demo_batching(table: Any, env: Any, quick: bool) -> None:
    """64 closed-loop callers of one sequence, batching against one client of 64 and against serial serving; and
    a lone caller, batching against serial."""
    from run import percentile, timed_together

    from resident_pool import AsyncPool, Pool

    case = "demo batching (minilm)"
    _providers(env.manifests)
    texts = _texts()
    rounds, seconds = (2, 10.0) if quick else (4, 30.0)
    with Pool() as pool:
        for slug in ("minilm", "minilm-serial"):
            pool.predict(slug, _payload(texts[:1]))  # each warm before its clock starts
        reference = _Reference(texts, pool.predict("minilm", _payload(texts)))
        reference.check(texts, pool.predict("minilm-serial", _payload(texts)))
        # one client, every sequence in one request: the ceiling
        one_client = [_timed(lambda: reference.check(texts, pool.predict("minilm", _payload(texts))))
                      for _ in range(rounds)]
    single = CALLERS / statistics.median(one_client)

    async def throughput() -> tuple[float, float]:
        async with AsyncPool() as apool:
            batched = await _closed_loop(apool, "minilm", texts, seconds, reference, shared=True)
            serial = await _closed_loop(apool, "minilm-serial", texts, seconds, reference, shared=False)
        return batched, serial

    batched, serial = asyncio.run(throughput())
    table.add(case, f"{CALLERS} callers, batching", batched, "seq/s", note=SHAPE)
    table.add(case, f"one client, {CALLERS} sequences per request", single, "seq/s", note=SHAPE)
    table.add(case, f"{CALLERS} callers, one request per call", serial, "seq/s",
              note="minilm-serial: a copy of minilm without [batching], same run")
    table.add(case, f"{CALLERS} callers batching / one client of {CALLERS}", batched / single, "x", ">= 0.9",
              batched / single >= 0.9)
    table.add(case, f"{CALLERS} callers batching / one request per call", batched / serial, "x", ">= 2",
              batched / serial >= 2)
    # About what batching can give on this machine: the sequences in one request against one a request. On this
    # 2-core CPU the model's work grows with its tokens whether they come together or not (1.66x here); on a GPU a
    # batch of 64 costs little more than one.
    table.add(case, f"one client of {CALLERS} / one request per call", single / serial, "x",
              note="what batching can gain over serial serving with this model on this machine, roughly")

    # a lone caller: one sequence a request, batching and serial taken in turn
    probe = texts[len(texts) // 2]
    with Pool() as pool:
        samples = timed_together({
            "minilm": lambda: reference.check([probe], pool.predict("minilm", _payload([probe]))),
            "minilm-serial": lambda: reference.check([probe], pool.predict("minilm-serial", _payload([probe]))),
        }, 20 if quick else 60, warmup=5)
        pool.stop("minilm-serial")  # its worker's memory and threads gone before the next case
    lone, lone_serial = percentile(samples["minilm"], 50), percentile(samples["minilm-serial"], 50)
    table.add(case, "lone caller p50, batching / serial", lone / lone_serial, "x", "<= 1.05",
              lone / lone_serial <= 1.05, note=f"one sequence of {len(probe)} residues, taken in turn: "
              f"{lone * 1e3:.1f} ms against {lone_serial * 1e3:.1f} ms")


def case_demo_mixed(table: Any, env: Any, quick: bool) -> None:
    """A campaign's chunk streams on the one replica, and an interactive sequence now and then."""
    from run import percentile, sequences

    from resident_pool import Pool

    case = "demo mixed (minilm)"
    chunks_n, arriving = (4, 10) if quick else (CAMPAIGN_CHUNKS, INTERACTIVE)
    # Chunks of CHUNK sequences of data/ cut to one window each (about 16,000 tokens: a model call of its own under
    # minilm's max_batch_work, as a chunk of whole proteins is), so the case takes a minute or two.
    campaign = sequences(chunks_n * CHUNK, residues=254)
    chunks = [campaign[at:at + CHUNK] for at in range(0, len(campaign), CHUNK)]
    probe = _texts()[CALLERS // 2]
    with Pool() as pool:
        reference = _Reference([probe], pool.predict("minilm", _payload([probe])))
        alone = []
        for chunk in chunks:  # each chunk alone: its compute time, and its reference answers
            began = time.perf_counter()
            answer = pool.predict("minilm", _payload(chunk))
            alone.append(time.perf_counter() - began)
            reference.add(chunk, answer)
        one_s = statistics.median(_timed(lambda: reference.check([probe], pool.predict(
            "minilm", _payload([probe]), priority="interactive"))) for _ in range(5))
    chunk_s = statistics.median(alone)
    span = chunk_s * len(chunks) / 2  # two streams, as a campaign on one replica runs (flows/screen.py)
    arrivals = [span * (0.05 + 0.8 * k / (arriving - 1)) for k in range(arriving)]
    run = _mixed("minilm", chunks, 2, arrivals, probe, reference)
    # The bound, from the chunks' compute time in the same run (the worker never idles while two streams send: the
    # campaign's makespan over its chunks): the call running when the interactive request comes (a chunk), and the next
    # call, which it rides in and which holds at most max_batch_work of tokens: a chunk's worth here (a chunk of
    # whole proteins, about 54,000 tokens, is a call of its own, and an interactive request rides alone).
    during = run["makespan"] / len(chunks)
    p95, bound = percentile(run["waits"], 95), 2 * during
    table.add(case, "interactive p95 during a campaign", p95, "s", "<= chunk + batch", p95 <= bound,
              note=f"{len(run['waits'])} interactive calls of one sequence, median "
                   f"{statistics.median(run['waits']):.2f} s, max {max(run['waits']):.2f} s; a chunk of {CHUNK} "
                   "sequences (one window each) "
                   f"{during:.2f} s each during the run, {chunk_s:.2f} s alone; the bound {bound:.2f} s; one sequence "
                   f"alone {one_s * 1e3:.0f} ms; 2 campaign streams")


def case_demo_failure(table: Any, env: Any, quick: bool) -> None:
    """64 callers at once, one poisoned, against the same burst unpoisoned: refused before the model runs, and
    failing inside it."""
    from resident_pool import AsyncPool, Pool

    case = "demo per-item failure"
    _providers(env.manifests)
    texts = _texts()
    with Pool() as pool:
        pool.predict("minilm-poison", _payload(texts[:1]))
        reference = _Reference(texts, pool.predict("minilm", _payload(texts)))
    repeats = 1 if quick else 3

    async def bursts() -> dict[str, list[tuple[float, list[str]]]]:
        out: dict[str, list[tuple[float, list[str]]]] = {}
        async with AsyncPool() as apool:
            for slug in ("minilm", "minilm-poison"):
                await _burst(apool, slug, texts, reference, None, "")  # every lease acquired, the workers warm
            for _ in range(repeats):  # taken in turn, so a busy moment of the host falls on both alike
                for label, slug, poison in (("before", "minilm", None), ("before, poisoned", "minilm", "MKV1LL"),
                                            ("inside", "minilm-poison", None),
                                            ("inside, poisoned", "minilm-poison", POISON)):
                    poisoned = None if poison is None else CALLERS // 3
                    out.setdefault(label, []).append(await _burst(apool, slug, texts, reference, poisoned,
                                                                  poison or ""))
        return out

    runs = asyncio.run(bursts())
    with Pool() as pool:
        pool.stop("minilm-poison")
    for where, limit, words, why in (
            ("before", 2, "refused before the model runs", "is not a residue letter"),
            ("inside", 4, "failing inside the model", "a poisoned window reached the model")):
        clean = statistics.median(elapsed for elapsed, _ in runs[where])
        poisoned = statistics.median(elapsed for elapsed, _ in runs[f"{where}, poisoned"])
        for _, errors in runs[f"{where}, poisoned"]:
            if len(errors) != 1 or why not in errors[0]:
                raise AssertionError(f"one poisoned input of {CALLERS} gave the errors {errors}")
        error = runs[f"{where}, poisoned"][0][1][0]
        table.add(case, f"one poisoned of {CALLERS}, {words}", poisoned / clean, "x", f"<= {limit}",
                  poisoned / clean <= limit,
                  note=f"{CALLERS - 1} answers and 1 error ({error[:90]}...) in {poisoned:.2f} s; unpoisoned "
                       f"{clean:.2f} s (medians of {repeats})")


RESIDUES = 64  # see case_demo_batching
SHAPE = f"{CALLERS} distinct sequences of data/, at most {RESIDUES} residues, one per request"
CHUNK = 64  # flows/screen.py's default chunk
CAMPAIGN_CHUNKS = 6
INTERACTIVE = 16

__all__ = ["case_demo_batching", "case_demo_failure", "case_demo_mixed"]
