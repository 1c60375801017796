"""Who listens on a local TCP port: its uid from /proc/net/tcp{,6}, its pid where it is ours; no internal imports.

Any local user may bind a free loopback port, so a client about to send a secret to ``127.0.0.1:PORT``
asks first whose socket answers there. Run as a module, it is the check `infra/local/stack.sh` makes
before it hands the Prefect API's auth string to what holds the port:

    python -m resident_pool.host.listeners PORT [--session PID]

exits 0 when every socket that may take a connection to 127.0.0.1:PORT is this user's (and, with
``--session``, held by a process of the session PID leads: the server the script started), 3 when
nothing listens there, and 1, with a sentence naming the holder on stderr, otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FREE", "OURS", "THEIRS", "Listener", "check_port", "listeners", "socket_pids", "user_name"]

OURS, THEIRS, FREE = 0, 1, 3  # the module's exit codes
_TABLES = (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6))
_LISTEN = "0A"
# A connection to 127.0.0.1 may reach a socket bound to it, to every address, or to IPv6's any address
# (dual-stack unless IPV6_V6ONLY, which /proc does not show: counted, to be safe).
_REACHES_LOOPBACK = {ipaddress.ip_address(a) for a in ("127.0.0.1", "0.0.0.0",  # noqa: S104 - compared, not bound
                                                          "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0")}


@dataclass(frozen=True, slots=True)
class Listener:
    """One listening TCP socket: where it is bound, its owner's uid and its inode."""

    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    uid: int
    inode: int

    def reaches_loopback(self) -> bool:
        return self.address in _REACHES_LOOPBACK


def listeners(port: int) -> list[Listener]:
    """Every listening TCP socket on ``port``, on any local address."""
    found = []
    for table, family in _TABLES:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            address, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) != port:
                continue
            found.append(Listener(_address(address, family), port, int(fields[7]), int(fields[9])))
    return found


def _address(text: str, family: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc prints it: 32-bit words in host byte order."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[at:at + 4][::-1] for at in range(0, len(raw), 4))
    return ipaddress.IPv4Address(raw) if family == 4 else ipaddress.IPv6Address(raw)


def socket_pids(inode: int) -> list[int]:
    """The pids of the processes holding socket ``inode`` whose descriptors this user may read (its own)."""
    target, pids = f"socket:[{inode}]", []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) == target for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def user_name(uid: int) -> str:
    """``uid N (name)``."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid} (no name)"


def _session(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses
    return int(stat.rsplit(")", 1)[1].split()[3])


def check_port(port: int, session: int | None = None) -> tuple[int, str]:
    """OURS, THEIRS or FREE for 127.0.0.1:``port``, and a sentence saying who holds it."""
    reaching = [found for found in listeners(port) if found.reaches_loopback()]
    if not reaching:
        return FREE, f"nothing listens on 127.0.0.1:{port}"
    for found in reaching:
        where = f"[{found.address}]:{port}" if found.address.version == 6 else f"{found.address}:{port}"
        if found.uid != os.getuid():
            return THEIRS, f"{where} is held by another user, {user_name(found.uid)}"
        if session is not None:
            pids = socket_pids(found.inode)
            if not any(_session(pid) == session for pid in pids):
                held = f"pid {', '.join(map(str, pids))}" if pids else "a process this user cannot see"
                return THEIRS, (f"{where} is held by another process of yours ({held}), not the one started "
                                f"as session {session}")
    return OURS, f"127.0.0.1:{port} is held by {'session ' + str(session) if session else 'you'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m resident_pool.host.listeners",
                                     description="Whether 127.0.0.1:PORT is held by you (exit 0), by nobody (3), "
                                                 "or by another user or process (1, named on stderr).")
    parser.add_argument("port", type=int)
    parser.add_argument("--session", type=int, help="the holder must be a process of this session (its leader's pid)")
    options = parser.parse_args(argv)
    code, said = check_port(options.port, options.session)
    if code == THEIRS:
        print(said, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
