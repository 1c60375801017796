"""The host admission service's configuration: a TOML file only its owner can write.

Quotas (GB and replicas) per user and per group, the classes each may claim, the socket, its
group, and where the service keeps its state. A file others can write is refused naming it:
whoever could edit it could give themselves the card.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .. import priority as order
from ..errors import ResidentPoolError

__all__ = ["EXAMPLE", "Limits", "ServiceConfig", "load_config"]


class Limits(BaseModel):
    """What one user (or the members of one group, together) may hold, and the classes they may claim."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_gb: float | None = Field(None, gt=0, description="GPU memory held at once, in GB (unset: no limit)")
    replicas: int | None = Field(None, ge=0, description="workers holding GPU memory at once (unset: no limit)")
    classes: tuple[str, ...] | None = Field(None, description="priority classes they may claim; a higher one is "
                                            "capped to the highest of these")

    @field_validator("gpu_gb", "replicas", "classes", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:  # a user's section inherits what it leaves out: "unset" there would mean two things
            raise ValueError("null is not a value here: leave the field out (a user's section then takes "
                             "[default]'s) or give a number or a list")
        return value

    @field_validator("classes")
    @classmethod
    def _known(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError("an empty list would let no class be capped to: name at least one (\"batch\")")
        for name in value or ():
            if not order.is_class(name):
                raise ValueError(f"{name!r} is not a class: one of {', '.join(order.CLASSES)}")
        return value


class ServiceConfig(BaseModel):
    """``resident-pool admission-service --config FILE``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: str = Field("/run/resident-pool/admission.sock", description="where pools connect (mode 0660)")
    group: str = Field("resident-pool", description="the socket's group: users in it may admit through the service")
    state_dir: Path = Field(Path("/var/lib/resident-pool"), description="the ledger, kept across restarts")
    audit: Path | None = Field(None, description="append every state of the ledger to this JSONL file")
    headroom_gb: float = Field(0.5, ge=0, description="kept free on every device")
    capacity_gb: str | None = Field(None, description="declared capacity where NVML cannot read: `80` or `0:80,1:80`")
    fake_nvml: str | None = Field(None, description="read device memory from this JSON file (tests, drills)")
    aging_s: float = Field(300.0, ge=0, description="a waiting request rises one class per this many seconds")
    backfill: bool = Field(True, description="a request that fits now may go ahead of one that does not")
    max_connections: int = Field(256, ge=1, description="connections served at once")
    max_connections_per_user: int = Field(16, ge=1, description="one user's connections at once")
    max_asks_per_pool: int = Field(256, ge=1, description="requests one pool may have waiting")
    orphan_grace_s: float = Field(150.0, gt=0, description="how long a worker's booking outlives its pool: the "
                                  "workers' default orphan_grace_s (120 s) and the 30 s their pool's heartbeat takes "
                                  "to go stale; past it the booking is given back")
    default: Limits = Field(Limits(), description="every user not named under [users]")
    users: dict[str, Limits] = Field(default_factory=dict, description="a user's own limits; each field left out "
                                     "is [default]'s")
    groups: dict[str, Limits] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _users_inherit(cls, data: Any) -> Any:
        """Each field a user's section leaves out is [default]'s, on its own: giving one user more memory does not
        give them every class, nor lift the default's replicas limit (groups bind their members on their own)."""
        if not isinstance(data, dict) or not isinstance(data.get("users"), dict):
            return data
        default = _given(data.get("default", {}))
        if not isinstance(default, dict):
            return data  # not a section: validation names it
        users = {name: {**default, **own} if isinstance(own := _given(section), dict) else section
                 for name, section in data["users"].items()}
        return {**data, "users": users}


def _given(section: Any) -> Any:
    """The fields a section names (a ``Limits`` built in code: those it was given)."""
    return section.model_dump(exclude_unset=True) if isinstance(section, Limits) else section


EXAMPLE = """\
# /etc/resident-pool/admission.toml: owned by root (or the service's user), writable by nobody else.
socket = "/run/resident-pool/admission.sock"
group = "resident-pool"            # users in this group may admit through the service
state_dir = "/var/lib/resident-pool"
headroom_gb = 0.5
aging_s = 300                      # a waiting request rises one class per 5 minutes
backfill = true

[default]                          # every user not named below
gpu_gb = 40
replicas = 4
classes = ["normal", "batch"]      # nobody makes everything interactive

[users.alice]                      # each field left out is [default]'s: alice keeps 40 GB and 4 replicas
classes = ["interactive", "normal", "batch"]

[groups.lab]                       # the members of the group, together
gpu_gb = 70
replicas = 8
classes = ["interactive"]          # members may claim interactive too
"""


def load_config(path: Path) -> ServiceConfig:
    """Read ``path``, refusing a file (or a folder above it) that anyone but its owner (root or this user) can
    write, and naming what is wrong in it."""
    path = Path(path)
    _trusted(path)
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ResidentPoolError(f"admission service config {path} does not exist; write one (`resident-pool "
                                "admission-service --example` prints one)", reason="bad_config") from None
    except tomllib.TOMLDecodeError as exc:
        raise ResidentPoolError(f"admission service config {path}: not TOML: {exc}", reason="bad_config") from None
    try:
        return ServiceConfig.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ResidentPoolError(f"admission service config {path}: {problems}", reason="bad_config") from None


def _trusted(path: Path) -> None:
    me = os.geteuid()
    for place in [path, *path.resolve().parents]:
        try:
            info = os.stat(place)
        except FileNotFoundError:
            continue
        if info.st_uid not in (0, me):
            raise ResidentPoolError(f"admission service config: {place} is owned by uid {info.st_uid}, not root or "
                                    "this service's user: refused (whoever owns it could give themselves the card); "
                                    f"chown root {place}", reason="untrusted_config")
        sticky = stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX
        if info.st_mode & 0o022 and not sticky:
            raise ResidentPoolError(f"admission service config: {place} is writable by its group or others: refused "
                                    f"(any of them could give themselves the card); chmod go-w {place}",
                                    reason="untrusted_config")
