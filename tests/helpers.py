"""Shared test helpers: polling, leak detection, the test worker's command."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from resident_pool.procs import pid_alive

WORKERS = Path(__file__).parent / "workers"
TEST_WORKER = WORKERS / "testworker.py"
TAG_VARIABLE = "RESIDENT_POOL_TEST_TAG"


def wait_until(condition, timeout=10.0, interval=0.02, message="condition"):
    """Poll ``condition`` until it returns truthy; return that value or fail at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)


def tagged_processes(tag: str) -> list[int]:
    """Live pids (not this one) whose environment carries this run's tag."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def describe_pids(pids) -> str:
    lines = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {command}")
        except OSError:
            lines.append(f"{pid}: (gone)")
    return "\n".join(lines)


def worker_command(*options, python=sys.executable, env=None):
    """A build_command for ResidentWorker that runs the test worker with ``options``."""

    def build(worker):
        return [python, str(TEST_WORKER), worker.socket_path, *options], dict(env or {})

    return build
