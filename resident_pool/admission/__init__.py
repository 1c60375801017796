"""GPU admission: device capacity, the ledger of what is held, and placing a budget where it fits.

The per-user ledger (``ledger.Ledger``) is the default; the host-wide admission service
(``service``, run as `resident-pool admission-service`) keeps one ledger for every user's
pool on the host, and ``remote.ServiceClient`` is how a pool talks to it.
"""

from __future__ import annotations

from .devices import Device, declared, read_devices
from .gate import Admission, Placement
from .ledger import Ledger

__all__ = ["Admission", "Device", "Ledger", "Placement", "declared", "read_devices"]
