"""Review r27: reproductions for issue 27 (the kept lease of Pool.predict, reused array buffers, campaign speed).

Each test fails on the reviewed code (daf32ea) and passes once its finding is fixed. Real pool, client and
worker processes; every process a test starts is reaped."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from providers import write_provider

from resident_pool import Pool


def _memfd_maps(pid: int | str = "self") -> list[str]:
    """The shared memfd mappings of our reused buffers that a process holds."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line.strip() for line in maps if "memfd:resident-pool" in line]


FORKED = textwrap.dedent(
    """
    import json, os, sys
    from resident_pool import Pool
    pool = Pool()
    pool.predict("one", {"action": "echo", "value": "warm"})  # the kept lease, before the fork
    pid = os.fork()
    me = "child" if pid == 0 else "parent"
    got = []
    for n in range(100):
        try:
            got.append([f"{me}-{n}", pool.predict("one", {"action": "echo", "value": f"{me}-{n}"})["echo"]])
        except Exception as error:
            got.append([f"{me}-{n}", f"{type(error).__name__}: {error}"])
        os.write(1, (json.dumps(got[-1]) + "\\n").encode())  # one write: parent's and child's lines never mix
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    pool.close()
    """
)


def test_a_forked_child_does_not_share_the_parents_kept_lease(pool_dir):
    """A Pool made before a fork (a module-level Pool, multiprocessing's fork start method, a Prefect process
    pool on Linux) is used in parent and child alike. The child inherits the thread-local link: the same pool
    connection, the same worker connection, the same kept lease and the same request-id counter. Calls in both
    processes at once interleave on one worker socket: each side reads the other's replies ("the worker answered
    request 3, not 20", KeyError 'slug' from a pool reply read as an acquire's), one side waits for a reply the
    other took (until request_timeout_s), and with equal ids one side can take the other's answer as its own.
    Seen: 3 of 40 calls failed in one run, and a hang in another. A client should notice its pid changed and
    open its own connections (and acquire its own lease) in the child."""
    write_provider(pool_dir, "one", "")
    proc = subprocess.Popen([sys.executable, "-c", FORKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
        finished = True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # parent and forked child share the new session's group
        out, err = proc.communicate()
        finished = False
    pairs = [json.loads(line) for line in out.splitlines() if line.startswith("[")]
    wrong = [pair for pair in pairs if pair[0] != pair[1]]
    assert finished and len(pairs) == 200 and not wrong, (
        f"finished: {finished}; {len(pairs)} of 200 calls answered, {len(wrong)} of them with another process's "
        f"reply or an error: {wrong[:5]}; stderr: {err[-800:]}")


def test_pool_predict_gives_its_reused_buffers_back_after_the_call(pool_dir):
    """docs/arrays.md: "The buffers, and the connection that carried them, close with the session; `Pool.predict`
    is a session of one request." With the kept lease, Pool.predict's session lives on after the call: a client
    that sent one 32 MiB array and dropped every reference to it and its answer still maps a 32 MiB populated
    memfd (its Slab: up to 4 free ones, 2 GiB, are kept) for as long as the kept lease lives, and the worker
    maps it too. A notebook that once predicted on a 1.5 GiB array holds 2 GiB of pre-faulted shared memory
    in each of the two processes until the lease is recalled. (Keep them if that is the design, and say so.)"""
    numpy = pytest.importorskip("numpy")
    write_provider(pool_dir, "arr", "", worker="arrayworker.py")
    with Pool() as pool:
        before = _memfd_maps()
        x = numpy.ones(32 << 20, numpy.uint8)
        answer = pool.predict("arr", {"action": "describe", "value": x})
        assert answer["type"] == "ndarray"
        del x, answer
        gc.collect()
        held = [line for line in _memfd_maps() if line not in before]
        assert not held, f"after Pool.predict returned, this client still maps its reused buffer(s): {held}"


def test_a_reused_buffer_near_the_cap_is_not_twice_the_array(monkeypatch):
    """Slabs.take rounds a buffer up to a power of two, capped by the receiver's limit: an array of 2 GiB and one
    page, under the 4 GiB default cap, gets a 4 GiB memfd populated up front (MADV_POPULATE_WRITE commits every
    page), so the client's peak is the array plus 4 GiB where a fresh sealed memfd cost the array plus 2 GiB.
    And a buffer over FREE_BYTES (2 GiB) is never kept free (``_recycle`` retires it), so the rounding that is
    meant to let the next message of a similar size fit buys nothing at that size: it is used once and closed.
    Measured without making it: make_slab is asked for the size and refuses (the message then goes in a fresh
    memfd, as the code already does when no buffer can be made)."""
    from resident_pool import arrays

    asked = []

    def refuse(size, name="resident-pool"):
        asked.append(size)
        raise OSError(12, "not made in this test")

    monkeypatch.setattr(arrays.protocol, "make_slab", refuse)
    nbytes = (2 << 30) + 4096
    assert arrays.Slabs().take(nbytes, 4 << 30) is None
    assert asked, "no buffer was asked for"
    assert asked[0] <= nbytes + (64 << 20), (
        f"a {nbytes / 2**30:.3f} GiB array asked for a {asked[0] / 2**30:.3f} GiB pre-faulted buffer, which is "
        f"over FREE_BYTES ({arrays.Slabs.FREE_BYTES / 2**30:g} GiB) and so is used once and retired")
