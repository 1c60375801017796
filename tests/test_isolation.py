"""Another local user cannot reach the pool, its workers or their transcripts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from resident_pool import Pool, StateDirError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.reliability
SYSTEM_PYTHON = "/usr/bin/python3"

PROBE = """
import socket, sys
kind, path = sys.argv[1], sys.argv[2]
try:
    if kind == "connect":
        s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(path); s.sendall(b'{"op": "status"}\\n')
        print("REACHED", s.recv(100))
    else:
        print("READ", open(path).read(100))
except PermissionError as exc:
    print("DENIED", exc)
except OSError as exc:
    print("DENIED", exc)
"""


def as_other(user, kind, path):
    done = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", SYSTEM_PYTHON, "-c",
                           PROBE, kind, path], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout + done.stderr


def test_another_user_cannot_connect_or_read(pool_dir, other_user):
    shutil.copytree(ROOT / "manifests" / "echo", pool_dir / "echo")
    with Pool() as pool:
        pool.predict("echo", {"secret": "payload"})
        (worker,) = pool.status()["workers"]
        assert os.path.exists(worker["socket"])  # a real target, so a DENIED below is the permission's doing
        for kind, path in (("connect", pool.socket_path), ("connect", worker["socket"]), ("read", worker["transcript"])):
            outcome = as_other(other_user, kind, path)
            assert outcome.startswith("DENIED"), f"{kind} {path}: {outcome}"
        assert pool.predict("echo", {"n": 1})["echo"] == {"n": 1}  # and the pool is none the worse


def test_the_pool_refuses_a_state_dir_another_user_controls(tmp_path, monkeypatch, other_user, reliability_row):
    import pwd

    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    info = pwd.getpwnam(other_user)
    os.chown(planted, info.pw_uid, info.pw_gid)
    monkeypatch.setenv("RESIDENT_POOL_STATE_DIR", str(planted))
    with pytest.raises(StateDirError, match=f"owned by uid {info.pw_uid}"):
        Pool()
    reliability_row("another local user (useradd + setpriv)",
                    "cannot connect to pool or worker sockets, read transcripts, or plant a state directory")
