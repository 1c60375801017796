"""Where the pool keeps its sockets, ledger, transcripts and caches: one ``Paths`` value, made from the settings."""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import StateDirError
from ..settings import Settings, xdg_dir
from .trust import check_chain

__all__ = ["LEDGER_FILE", "POOL_SOCKET", "Paths", "default_results_dir", "ensure_private_dir"]

POOL_SOCKET = "pool.sock"
# What every worker of this user on this host holds (admission's ledger); the pool and a standalone
# supervisor with a budget keep their entries in the same file.
LEDGER_FILE = "ledger.json"


@dataclass(frozen=True)
class Paths:
    """The folders of one pool or client, chosen once from its settings (``Paths.of``) and handed down.

    The choice is made here; a folder is created (0700) and checked to be private when it is asked for
    (``state_dir()``, ``log_dir()``), so a folder another user could reach is refused at its first use.
    """

    state: Path  # sockets, ledger, locks (RESIDENT_POOL_STATE_DIR)
    logs: Path  # transcripts, the pool's own log and events (RESIDENT_POOL_LOG_DIR)
    cache: Path  # the weights hash cache, GPU peaks, the kits' default JIT caches (RESIDENT_POOL_CACHE_DIR)
    results: Path  # the campaign result store (RESIDENT_POOL_RESULTS_DIR)

    @classmethod
    def of(cls, config: Settings) -> Paths:
        """The folders ``config`` names, else the XDG defaults the spec gives."""
        return cls(state=config.state_dir or _default_state_dir(),
                   logs=config.log_dir or xdg_dir("state") / "resident-pool" / "logs",
                   cache=config.cache_dir or xdg_dir("cache") / "resident-pool",
                   results=config.results_dir or default_results_dir())

    def state_dir(self) -> Path:
        """The per-user state directory, created 0700 and checked to be private."""
        if sys.platform != "linux":
            raise StateDirError(f"resident-pool runs on Linux only (this is {sys.platform}): it relies on AF_UNIX "
                                "peer credentials (SO_PEERCRED) and /proc to know who is on each end")
        return ensure_private_dir(self.state, "state directory", "RESIDENT_POOL_STATE_DIR")

    def log_dir(self) -> Path:
        """The per-user transcript directory, created 0700; it outlives the pool and its state dir."""
        return ensure_private_dir(self.logs, "log directory", "RESIDENT_POOL_LOG_DIR")

    def pool_socket(self) -> str:
        """The pool's socket in the state directory."""
        return str(self.state_dir() / POOL_SOCKET)

    def ledger_path(self) -> Path:
        """The admission ledger in the state directory."""
        return self.state_dir() / LEDGER_FILE

    def workers_dir(self) -> Path:
        """The folder of per-worker run folders (each: its socket and heartbeat)."""
        return ensure_private_dir(self.state_dir() / "w", "workers folder", "RESIDENT_POOL_STATE_DIR")


def _default_state_dir() -> Path:
    """``$XDG_RUNTIME_DIR/resident-pool``, else a per-user folder in the temp dir (or, squatted, under XDG state)."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return xdg_dir("runtime") / "resident-pool"
    path = xdg_dir("runtime") / f"resident-pool-{os.getuid()}"
    if _squatted(path):
        # The temp folder is shared: another user made this name first. Clients and the pool
        # all come here by the same rule, so they still meet, in a folder only this user owns.
        return xdg_dir("state") / "resident-pool" / "run"
    return path


def _squatted(path: Path) -> bool:
    """Whether ``path`` exists as something this user did not make (another's folder, a link)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return info.st_uid != os.getuid() or stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode)


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
