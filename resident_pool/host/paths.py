"""Where the pool keeps its sockets, ledger and transcripts."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from ..errors import StateDirError
from ..settings import settings, xdg_dir
from .trust import check_chain

__all__ = ["LEDGER_FILE", "POOL_SOCKET", "cache_dir", "default_results_dir", "ensure_private_dir", "ledger_path",
           "log_dir", "pool_socket", "state_dir", "workers_dir"]

POOL_SOCKET = "pool.sock"
# What every worker of this user on this host holds (admission's ledger); the pool and a standalone
# supervisor with a budget keep their entries in the same file.
LEDGER_FILE = "ledger.json"


def state_dir() -> Path:
    """The per-user state directory, created 0700 and checked to be private."""
    if sys.platform != "linux":
        raise StateDirError(f"resident-pool runs on Linux only (this is {sys.platform}): it relies on AF_UNIX "
                            "peer credentials (SO_PEERCRED) and /proc to know who is on each end")
    configured = settings().state_dir
    if configured:
        path = configured
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = xdg_dir("runtime") / "resident-pool"
    else:
        path = xdg_dir("runtime") / f"resident-pool-{os.getuid()}"
        if _squatted(path):
            # The temp folder is shared: another user made this name first. Clients and the pool
            # all come here by the same rule, so they still meet, in a folder only this user owns.
            path = xdg_dir("state") / "resident-pool" / "run"
    return ensure_private_dir(path, "state directory", "RESIDENT_POOL_STATE_DIR")


def _squatted(path: Path) -> bool:
    """Whether ``path`` exists as something this user did not make (another's folder, a link)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return info.st_uid != os.getuid() or stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode)


def pool_socket(state: Path | None = None) -> str:
    """The pool's socket in ``state`` (the state directory by default)."""
    return str((state or state_dir()) / POOL_SOCKET)


def ledger_path(state: Path | None = None) -> Path:
    """The admission ledger in ``state`` (the state directory by default)."""
    return (state or state_dir()) / LEDGER_FILE


def workers_dir(state: Path | None = None) -> Path:
    """The folder of per-worker run folders (each: its socket and heartbeat)."""
    return ensure_private_dir((state or state_dir()) / "w", "workers folder", "RESIDENT_POOL_STATE_DIR")


def log_dir() -> Path:
    """The per-user transcript directory; it outlives the pool and its state dir."""
    path = settings().log_dir or xdg_dir("state") / "resident-pool" / "logs"
    return ensure_private_dir(path, "log directory", "RESIDENT_POOL_LOG_DIR")


def cache_dir() -> Path:
    """The pool's cache folder (the weights hash cache, GPU peaks, the kits' JIT caches): RESIDENT_POOL_CACHE_DIR,
    else under XDG's."""
    return settings().cache_dir or xdg_dir("cache") / "resident-pool"


def ensure_private_dir(path: Path, what: str, variable: str) -> Path:
    """Create ``path`` 0700, or refuse one that another user could reach."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateDirError(
            f"{what} {path} cannot be created ({exc.strerror}); set {variable} to a directory you own"
        ) from exc
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise StateDirError(f"{what} {path} is not a plain directory; set {variable} to a directory you own")
    if info.st_uid != os.getuid():
        raise StateDirError(
            f"{what} {path} is owned by uid {info.st_uid}, not by you (uid {os.getuid()}); "
            f"another user could read or replace its sockets: set {variable} to a directory you own"
        )
    if info.st_mode & 0o077:
        raise StateDirError(
            f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}, open to group or others; "
            f"run `chmod 700 {path}` or set {variable} to a private directory"
        )
    check_chain(path, what, error=StateDirError)  # a folder above it another user can write could swap it
    return path


def default_results_dir() -> Path:
    """Where results live unless RESIDENT_POOL_RESULTS_DIR says: ``$XDG_DATA_HOME/resident-pool/results``."""
    return xdg_dir("data") / "resident-pool" / "results"
