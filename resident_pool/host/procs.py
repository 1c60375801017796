"""Process helpers: environments, liveness, process groups; no internal imports."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from typing import Protocol

__all__ = [
    "ForkRefused",
    "ProcessHandle",
    "Spawner",
    "child_env",
    "group_members",
    "pid_alive",
    "process_start",
    "signal_group",
    "terminate_group",
    "wait_exit",
]

# After SIGKILL a process in uninterruptible sleep (stuck in a driver call) may never be
# reapable; a stop must not hang the pool on it.
KILL_WAIT_S = 10.0


class ProcessHandle(Protocol):
    """What a worker's owner uses of its process: ``subprocess.Popen``'s subset, so a spawned
    worker (a Popen) and a forked one (``zygote.ForkedProcess``) are handled alike."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None:
        """The return code once it ended (negative: killed by that signal), else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Its return code; raises ``subprocess.TimeoutExpired`` when it runs past ``timeout``."""


class ForkRefused(Exception):
    """A fork server would not (or could not) fork this worker; the owner spawns it instead."""


class Spawner(Protocol):
    """Starts a worker by forking it from a process that already imported its stack."""

    def fork(self, argv: list[str], env: Mapping[str, str], stdout_fd: int, cwd: str) -> ProcessHandle:
        """The forked worker (a session of its own, ``env`` as its whole environment, its output on
        ``stdout_fd``); raises ForkRefused when it cannot."""


def child_env(extra_env: Mapping[str, str | None], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` with ``extra_env`` layered over it: a str sets, None removes."""
    env = dict(os.environ if environ is None else environ)
    for name, value in extra_env.items():
        if value is None:
            env.pop(name, None)
        elif isinstance(value, str):
            env[name] = value
        else:
            raise TypeError(f"environment value for {name} must be a str or None, not {type(value).__name__}")
    return env


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie no one has reaped yet counts as dead."""
    try:
        os.kill(pid, 0)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
        if exc.errno != errno.EPERM:  # EPERM: alive, owned by someone else
            raise
    if not os.path.isdir("/proc"):
        return True
    # The state follows the command name, which may itself hold spaces.
    fields = _stat_fields(str(pid))
    return bool(fields) and fields[0] not in (b"Z", b"X")


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to a process group; False when no member is left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_exit(proc: ProcessHandle, timeout: float) -> int | None:
    """Reap ``proc`` within ``timeout`` seconds; its return code, or None if still running."""
    try:
        return proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (tells it from a later process given the same pid)."""
    fields = _stat_fields(str(pid))
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _stat_fields(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) pids in process group ``pgid``."""
    if not os.path.isdir("/proc"):
        return [pgid] if signal_group(pgid, 0) else []
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        # Fields after the name: state, ppid, pgrp, ...
        if fields and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def _group_alive(pgid: int) -> bool:
    # Orphaned children are reparented to pid 1, which in some containers
    # never reaps them: a zombie must not count as a survivor.
    try:
        return bool(group_members(pgid))
    except OSError:  # out of descriptors: /proc cannot be listed, but a signal still says who lives
        return signal_group(pgid, 0)


def terminate_group(proc: ProcessHandle, grace_s: float, kill_wait_s: float = KILL_WAIT_S) -> int | None:
    """SIGTERM the worker's process group, wait, then SIGKILL what is left; its return code.

    The worker runs in a session of its own (``start_new_session``), so its
    group id is its pid and its children (DataLoader workers, a kit's helpers)
    go with it. None when even SIGKILL did not end it within ``kill_wait_s``.
    """
    pgid = proc.pid
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    rc = wait_exit(proc, grace_s)
    # Children may linger after the leader; give them the rest of the grace.
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    signal_group(pgid, signal.SIGKILL)
    if rc is None:
        rc = wait_exit(proc, kill_wait_s)
    return rc
