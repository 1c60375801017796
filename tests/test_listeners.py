"""resident_pool.host.listeners: whose socket answers on 127.0.0.1:PORT, before a secret is sent there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from helpers import free_port, wait_until

from resident_pool.host.listeners import FREE, OURS, THEIRS, check_port, listeners


def _listening(family: int, address: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen()
    return sock


def test_a_port_nobody_holds_is_free_and_one_of_yours_is_yours():
    with _listening(socket.AF_INET, "127.0.0.1") as sock:
        port = sock.getsockname()[1]
        assert [(str(found.address), found.uid) for found in listeners(port)] == [("127.0.0.1", os.getuid())]
        assert check_port(port)[0] == OURS
        assert check_port(port, session=os.getsid(0))[0] == OURS
    assert check_port(port) == (FREE, f"nothing listens on 127.0.0.1:{port}")


def test_a_socket_of_yours_outside_the_session_is_not_the_server_that_session_started():
    with _listening(socket.AF_INET6, "::") as sock:  # dual-stack: it takes connections to 127.0.0.1 too
        port = sock.getsockname()[1]
        code, said = check_port(port, session=1)
    assert code == THEIRS
    assert said == (f"[::]:{port} is held by another process of yours (pid {os.getpid()}), not the one started "
                    "as session 1")


def test_a_socket_on_another_loopback_address_does_not_answer_127_0_0_1():
    with _listening(socket.AF_INET, "127.0.0.2") as sock:
        assert check_port(sock.getsockname()[1])[0] == FREE


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0", "::"])
def test_another_users_listener_is_named_by_uid_and_the_module_exits_1(other_user, address):
    from conftest import SYSTEM_PYTHON

    port = free_port()
    family = "AF_INET6" if ":" in address else "AF_INET"
    hold = (f"import socket, time\ns = socket.socket(socket.{family})\ns.bind(({address!r}, {port}))\ns.listen()\n"
            "time.sleep(120)\n")
    holder = subprocess.Popen(["setpriv", f"--reuid={other_user}", f"--regid={other_user}", "--clear-groups",
                               SYSTEM_PYTHON, "-c", hold])
    try:
        wait_until(lambda: listeners(port), timeout=30, message="the other user's socket to listen")
        done = subprocess.run([sys.executable, "-m", "resident_pool.host.listeners", str(port)], capture_output=True,
                              text=True, timeout=60, check=False)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    shown = f"[{address}]" if ":" in address else address
    assert done.returncode == THEIRS
    assert done.stderr.startswith(f"{shown}:{port} is held by another user, uid ") and f"({other_user})" in done.stderr
