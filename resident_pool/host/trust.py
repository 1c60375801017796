"""Who may have written a file the pool runs or reads as you: you, or root; nobody else."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from ..errors import ManifestError, ResidentPoolError

__all__ = ["check_chain", "check_trusted", "others_may_write"]

# Links followed on one path before it is refused as a loop (the kernel's own limit).
_MAX_LINKS = 40


def _private_group(gid: int) -> bool:
    """A group nobody but you is in (a user-private group, or ``users`` inside a one-user container such as
    Jupyter's images): its write bit adds nobody. Members are those listed and those whose primary group it is."""
    try:
        group = grp.getgrgid(gid)
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return False
    if set(group.gr_mem) - {me}:
        return False
    return not any(account.pw_gid == gid and account.pw_name != me for account in pwd.getpwall())


def check_trusted(path: Path, what: str, slug: str | None = None, field: str | None = None,
                  error: type[ResidentPoolError] = ManifestError) -> None:
    """Refuse ``path`` when another user owns it or group or others may write it, naming the fix.

    Whoever can write a manifest, a worker script, a pinned weights file (a pickle is code) or
    the folder holding one can run code as you. A root-owned, read-only store is fine. Every
    folder and link on the way to it is held to the same rule (``check_chain``).
    """
    check_chain(path, what, slug, field, error)
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
    writable = others_may_write(info)
    if writable:
        raise error(
            f"{path}: {what} is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):04o}), so "
            f"another user can change what runs as you; run `chmod go-w {path}`",
            slug=slug, details={"field": field, "mode": stat.S_IMODE(info.st_mode)})


def others_may_write(info: os.stat_result) -> list[str]:
    """Who besides you may write what ``info`` describes: "group" (unless nobody else is in it), "others"."""
    writable = []
    if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid):
        writable.append("group")
    if info.st_mode & stat.S_IWOTH:
        writable.append("others")
    return writable


def check_chain(path: Path, what: str, slug: str | None = None, field: str | None = None,
                error: type[ResidentPoolError] = ManifestError) -> None:
    """Refuse ``path`` when a folder above it, or a link on the way, lets another user swap what it holds.

    As OpenSSH's StrictModes: every folder from ``/`` down, and every symlink followed (each one's
    target walked the same way), must be yours or root's, and no folder writable by group or others,
    except a sticky one such as ``/tmp`` (there only an entry's owner may replace it, and the entry
    walked through must be yours or root's). The leaf itself is ``check_trusted``'s.
    """
    uid = os.getuid()
    # Not os.path.abspath: it drops "link/.." by spelling, where the kernel follows the link first.
    todo = list((Path(os.getcwd()) / path).parts[1:])
    current = Path("/")
    links = 0
    while todo:
        name = todo.pop(0)
        if name in (".", ""):
            continue
        if name == "..":
            current = current.parent
            continue
        child = current / name
        try:
            info = child.lstat()
        except OSError:
            return  # missing: whoever reads it next says so
        if not todo and not stat.S_ISLNK(info.st_mode):
            return  # the leaf: check_trusted's
        if info.st_uid not in (uid, 0):
            kind = "the link" if stat.S_ISLNK(info.st_mode) else "the folder"
            raise error(
                f"{path}: {what} is reached through {kind} {child}, owned by uid {info.st_uid}, not by you "
                f"(uid {uid}) or root, so another user can swap what it holds; keep it under folders of your own",
                slug=slug, details={"field": field, "folder": str(child), "owner": info.st_uid})
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise error(f"{path}: {what}: too many levels of symbolic links", slug=slug, details={"field": field})
            target = Path(os.readlink(child))
            if target.is_absolute():
                current = Path("/")
            todo = [part for part in target.parts if part != "/"] + todo
            continue
        writable = others_may_write(info)
        if writable and not info.st_mode & stat.S_ISVTX:
            raise error(
                f"{path}: {what} lies under {child}, writable by {' and '.join(writable)} (mode "
                f"{stat.S_IMODE(info.st_mode):04o}), so another user can swap what it holds; run `chmod go-w "
                f"{child}` (or `chmod +t {child}` for a shared scratch folder), or keep it elsewhere",
                slug=slug, details={"field": field, "folder": str(child), "mode": stat.S_IMODE(info.st_mode)})
        current = child
