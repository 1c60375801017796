"""protocol.bind_unix puts a socket in place whole: a second outside review's probes (link refused, names in use, links)."""

from __future__ import annotations

import errno
import os
import socket
import stat

import pytest

from resident_pool import protocol


def test_a_folder_whose_file_system_or_sandbox_refuses_link_with_enosys_or_eacces_still_gets_its_socket(
        tmp_path, monkeypatch):
    """link() refused for a reason other than EPERM/EOPNOTSUPP (a FUSE file system without link: ENOSYS; an LSM
    or seccomp rule: EACCES) fails the bind, though the rename the fallback makes would have worked."""
    path = tmp_path / "w.sock"
    for code in (errno.ENOSYS, errno.EACCES):
        def refused(src, dst, *a, _code=code, **k):
            raise OSError(_code, os.strerror(_code))
        monkeypatch.setattr(protocol.os, "link", refused)
        listener = protocol.bind_unix(path)  # main: OSError ENOSYS
        try:
            assert stat.S_ISSOCK(os.lstat(path).st_mode)
        finally:
            listener.close()
            os.unlink(path)
        assert sorted(os.listdir(tmp_path)) == []


def test_an_interrupt_after_a_taken_temporary_name_never_unlinks_that_name(tmp_path, monkeypatch):
    """A random name that was taken (EADDRINUSE: someone's file) stays in ``temp`` until the next name is drawn;
    an interrupt in between makes the cleanup unlink the other owner's file."""
    theirs = tmp_path / ".00000001.s"
    theirs.write_text("someone's")
    draws = iter([b"\x00\x00\x00\x01"])

    def urandom(n):
        try:
            return next(draws)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(protocol.os, "urandom", urandom)
    with pytest.raises(KeyboardInterrupt):
        protocol.bind_unix(tmp_path / "w.sock")
    assert theirs.exists(), "bind_unix unlinked a file it did not make"


def test_umask_is_restored_when_every_temporary_name_is_taken(tmp_path, monkeypatch):
    before = os.umask(0o022)
    os.umask(before)
    real_bind = socket.socket.bind

    class Taken(socket.socket):
        def bind(self, address):
            raise OSError(errno.EADDRINUSE, "taken")

    monkeypatch.setattr(protocol.socket, "socket", Taken)
    with pytest.raises(OSError, match="no free temporary name"):
        protocol.bind_unix(tmp_path / "w.sock")
    now = os.umask(before)
    assert now == before and os.listdir(tmp_path) == []
    del real_bind


def test_symlinks_at_the_path_are_refused_and_nothing_is_left(tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()
    (tmp_path / "file").write_text("x")
    for target in (stale, tmp_path / "file", tmp_path / "missing"):
        link = tmp_path / "w.sock"
        link.symlink_to(target)
        with pytest.raises(OSError, match="not a socket"):
            protocol.bind_unix(link)
        assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["file", "stale.sock", "w.sock"]
        link.unlink()


def test_a_folder_that_is_a_symlink_and_an_interrupt_between_bind_and_link(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    listener = protocol.bind_unix(tmp_path / "via" / "w.sock")
    listener.close()
    assert os.listdir(real) == ["w.sock"]
    os.unlink(real / "w.sock")

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(protocol, "_put_in_place", interrupted)
    with pytest.raises(KeyboardInterrupt):
        protocol.bind_unix(real / "w.sock", mode=0o660, gid=os.getgid())
    assert os.listdir(real) == []
