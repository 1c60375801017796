"""Who may have written a file the pool runs or reads as you: you, or root; nobody else."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from .errors import ManifestError, ResidentPoolError

__all__ = ["check_trusted"]


def _private_group(gid: int) -> bool:
    """A user-private group (named after you, no other members): its write bit adds nobody."""
    try:
        group = grp.getgrgid(gid)
        user = pwd.getpwuid(os.getuid())
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and not set(group.gr_mem) - {user.pw_name}


def check_trusted(path: Path, what: str, slug: str | None = None, field: str | None = None,
                  error: type[ResidentPoolError] = ManifestError) -> None:
    """Refuse ``path`` when another user owns it or group or others may write it, naming the fix.

    Whoever can write a manifest, a worker script, a pinned weights file (a pickle is code) or
    the folder holding one can run code as you. A root-owned, read-only store is fine.
    """
    try:
        info = path.stat()
    except OSError as exc:
        raise error(f"{path}: {what} cannot be read: {exc.strerror}", slug=slug,
                    details={"field": field}) from None
    uid = os.getuid()
    if info.st_uid not in (uid, 0):
        raise error(
            f"{path}: {what} is owned by uid {info.st_uid}, not by you (uid {uid}) or root, so another user can "
            f"change what runs as you; use your own copy, or `chown {uid} {path}` if you trust it",
            slug=slug, details={"field": field, "owner": info.st_uid})
    writable = []
    if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid):
        writable.append("group")
    if info.st_mode & stat.S_IWOTH:
        writable.append("others")
    if writable:
        raise error(
            f"{path}: {what} is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):04o}), so "
            f"another user can change what runs as you; run `chmod go-w {path}`",
            slug=slug, details={"field": field, "mode": stat.S_IMODE(info.st_mode)})
