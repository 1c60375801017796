"""systemd's readiness and watchdog protocol (``Type=notify``, ``WatchdogSec=``), standard library only.

``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` are systemd's own variables,
set by it for the service it starts; outside systemd they are absent and this does nothing.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "watchdog_interval_s"]


def notify(message: str) -> bool:
    """Send ``message`` ("READY=1", "WATCHDOG=1", "STOPPING=1", "STATUS=...") to systemd; False when not under it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1 (half the unit's WatchdogSec), or None when no watchdog is armed for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.1, int(usec) / 1e6 / 2)
    except ValueError:
        return None
