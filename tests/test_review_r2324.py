"""Outside review of issues 23 (code written to the original design) and 24 (trust, third round).

Each test is one defect found by trying to break what was built: it fails now. Workers, kits and callers are in
tests/review_r2324/, written from the original design's three reference files alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from providers import write_provider

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).parent / "review_r2324"
KITS = HERE / "kits"
STACK = ROOT / "infra" / "local" / "stack.sh"
sys.path.insert(0, str(ROOT / "flows"))


# -- at HEAD (94b768c): no pool starts any worker ------------------------------------------------------------------


def test_review_a_pool_starts_a_plain_worker_at_all(pool_dir):
    """server/starts.py:54 writes ``self.workers[...]`` on the Starter, which has no ``workers``: every first start
    of a replica fails with AttributeError, so every pool, CLI and Prefect path of both issues is down at HEAD."""
    from resident_pool import Pool

    write_provider(pool_dir, "echo", "")
    with Pool(manifests=pool_dir) as pool:
        answer = pool.predict("echo", {"x": 1})
        pool.stop("echo")
    assert answer is not None


# -- issue 23: a caller written to the original supervisor -----------------------------------------------------------


def test_review_a_build_command_whose_argv_holds_paths_starts_its_worker():
    """The original supervisor hands `build_command`'s argv to Popen as it is, and Popen takes path objects: a
    caller's builder written as `[python, Path(__file__).with_name("worker.py"), worker.socket_path]` ran. Here
    the worker is spawned, then `WorkerProcess._started` joins the argv for its note (`' '.join(launch.argv)`,
    worker_process.py:224) and raises a bare TypeError; the spawned worker is killed and the caller gets neither
    a reply nor a WorkerStartError. Expected: the reply."""
    from resident_pool.supervisor import ResidentWorker

    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    script = Path(__file__).parent / "original" / "worker.py"

    def build(worker):
        return [python, script, worker.socket_path], {"ORIGINAL_CALLER": "1"}

    worker = ResidentWorker("origin", build)
    try:
        with worker.lock:
            reply = worker.request({"op": "predict", "sequence": "MKV"})
    finally:
        worker.stop()
    assert reply["ok"] and reply["result"]["reversed"] == "VKM"
