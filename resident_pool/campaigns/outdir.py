"""A campaign's output folder, held open: every file in it is made, replaced and removed relative to it.

Its path is checked once, the way manifests' are (``check_chain``: no folder above it or link on the way
that another user could swap), then opened without following a last link; from then on nothing goes by
path, so a link planted mid-run (``screened -> ~mallory/x``) is never followed (openat/renameat through
``dir_fd``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import InputError
from ..host.trust import check_chain

__all__ = ["OutputDir"]


class OutputDir:
    """An open output folder; ``close()`` it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(path))
        self.fd = _open_folder(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def open(self, name: str, flags: int) -> int:
        """Open ``name`` in the folder for writing, never through a link; created with the user's umask."""
        try:
            # O_NONBLOCK: a FIFO planted under this name fails at once (ENXIO) instead of hanging the run.
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | flags,
                           0o666, dir_fd=self.fd)
        except OSError as exc:
            raise InputError(f"{self.path / name}: cannot write the output there ({exc.strerror}); a symlink is "
                             "never followed", details={"path": str(self.path / name)}) from None

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)


def _open_folder(path: Path) -> int:
    where = {"path": str(path)}
    check_chain(path, "the output folder", error=InputError)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"{path}: the output folder cannot be made ({exc.strerror})", details=where) from None
    check_chain(path, "the output folder", error=InputError)  # folders just made are ours; any found, checked
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(f"{path}: the output folder cannot be opened ({exc.strerror}); a symlink is never "
                         "followed: give the folder itself", details=where) from None
    info = os.fstat(fd)
    if info.st_uid not in (os.getuid(), 0):
        os.close(fd)
        raise InputError(f"{path}: the output folder is owned by uid {info.st_uid}, not by you (uid {os.getuid()}) "
                         "or root, so its owner decides what your outputs become; write them into a folder of "
                         "your own", details={**where, "owner": info.st_uid})
    if not stat.S_ISDIR(info.st_mode):  # O_DIRECTORY already says so; kept for a reader of this function
        os.close(fd)
        raise InputError(f"{path}: not a folder", details=where)
    return fd
