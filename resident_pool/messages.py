"""The pool's control messages, one definition shared by the pool and its clients.

Each is a small dataclass: ``to_message()`` gives the JSON object a client sends,
``parse(message)`` checks one that arrived and raises ``ResidentPoolError(reason="bad_request")``
naming what is wrong, before anything changes. A payload never travels here: only control.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from . import priority as order
from .errors import ResidentPoolError

__all__ = ["KEY", "RELEASE_OUTCOMES", "SLUG", "Acquire", "LeaseGrant", "Release", "StopWorkers", "Used", "Variant",
           "Warm", "bad_request"]

# A provider name: never a path, never an option.
SLUG = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
# What the pool knows a provider by: its slug, or ``slug~variant`` for a build of it another way.
KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}(~[a-z0-9][a-z0-9_-]{0,39})?")
# bad_reply: the worker answered in a form its client could not read (it lives: checked before it serves again)
RELEASE_OUTCOMES = ("ok", "broken", "exiting", "timeout", "abandoned", "bad_reply")
_HOLDER_KEYS, _HOLDER_CHARS = 8, 300


def bad_request(message: str) -> ResidentPoolError:
    return ResidentPoolError(message, reason="bad_request")


def _slug(value: Any, what: str = "provider name") -> str:
    if not isinstance(value, str) or not SLUG.fullmatch(value):
        raise bad_request(f"{what} {value!r} is not a slug: lowercase letters, digits, '-' or '_', at most 40 "
                          "characters")
    return value


def _folder(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise bad_request("manifests must be a folder path")
    return value


def _holder(raw: Any) -> dict[str, str]:
    """Who a lease is for (a flow run's name, id and URL), as the client says; short strings only."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > _HOLDER_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= _HOLDER_CHARS for k, v in raw.items()):
        raise bad_request(f"holder must be a mapping of at most {_HOLDER_KEYS} short strings")
    return dict(raw)


def _priority(value: Any) -> str:
    if value is None:
        return order.DEFAULT
    if not order.is_class(value):
        raise bad_request(f"priority {value!r} is not a class: one of {', '.join(order.CLASSES)}")
    return value


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_request(f"{what} must be a count, not {value!r}")
    return value


@dataclass(frozen=True)
class Variant:
    """A build of a provider another way: its kit in another mode, or without its kit (a check's stock run)."""

    name: str
    kit_mode: str | None = None
    without_kit: bool = False

    @classmethod
    def parse(cls, raw: Any) -> Variant | None:
        if raw is None:
            return None
        if (not isinstance(raw, dict) or set(raw) - {"name", "kit_mode", "without_kit"}
                or not isinstance(raw.get("name"), str) or not SLUG.fullmatch(raw["name"])
                or not (raw.get("kit_mode") is None or (isinstance(raw["kit_mode"], str)
                                                         and SLUG.fullmatch(raw["kit_mode"])))
                or not isinstance(raw.get("without_kit", False), bool)):
            raise bad_request("variant must be {name, kit_mode, without_kit}: a slug-like name and kit mode, "
                              "and a boolean")
        return cls(raw["name"], raw.get("kit_mode"), raw.get("without_kit", False))


@dataclass(frozen=True)
class Acquire:
    """Lease a replica of ``slug`` (starting one where the provider may have another)."""

    op: ClassVar[str] = "acquire"
    slug: str
    manifests: str | None = None
    holder: dict[str, str] | None = None
    variant: Variant | None = None
    priority: str = order.DEFAULT  # interactive, normal or batch: where it waits (priority.py says the order)
    keep: bool = False  # Pool.predict's: kept between calls until the pool recalls it

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Acquire:
        keep = message.get("keep", False)
        if not isinstance(keep, bool):
            raise bad_request(f"acquire keep must be true or false, not {keep!r}")
        return cls(_slug(message.get("slug")), _folder(message.get("manifests")), _holder(message.get("holder")),
                   Variant.parse(message.get("variant")), _priority(message.get("priority")), keep)

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"op": self.op, "slug": self.slug, "manifests": self.manifests,
                                   "priority": self.priority}
        if self.keep:
            message["keep"] = True
        if self.holder:
            message["holder"] = self.holder
        if self.variant is not None:
            message["variant"] = asdict(self.variant)
        return message


@dataclass(frozen=True)
class Release:
    """End a lease: ``outcome`` says how its last request ended; ``reply`` is the worker's (for ``exiting``)."""

    op: ClassVar[str] = "release"
    lease: int
    outcome: str = "ok"
    served: int = 0
    reply: dict[str, Any] | None = None

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Release:
        lease, outcome = message.get("lease"), message.get("outcome", "ok")
        if not isinstance(lease, int) or isinstance(lease, bool):
            raise bad_request(f"release needs an integer lease, not {lease!r}")
        if outcome not in RELEASE_OUTCOMES:
            raise bad_request(f"release outcome {outcome!r} is not one of {', '.join(RELEASE_OUTCOMES)}")
        reply = message.get("reply")
        if reply is not None and not isinstance(reply, dict):
            raise bad_request("release reply must be the worker's reply object")
        return cls(lease, outcome, _count(message.get("served", 0), "release served"), reply)

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"op": self.op, "lease": self.lease, "outcome": self.outcome, "served": self.served}
        if self.reply is not None:
            message["reply"] = self.reply
        return message


@dataclass(frozen=True)
class Used:
    """A kept lease served ``served`` more requests: the pool counts it idle from now (sent now and then, no
    answer waited for); ``queue_wait_s``: how long its last request waited in a batching worker's queue."""

    op: ClassVar[str] = "used"
    lease: int
    served: int = 0
    queue_wait_s: float | None = None

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Used:
        lease = message.get("lease")
        if not isinstance(lease, int) or isinstance(lease, bool):
            raise bad_request(f"used needs an integer lease, not {lease!r}")
        wait = message.get("queue_wait_s")
        if wait is not None and (not isinstance(wait, int | float) or isinstance(wait, bool) or not 0 <= wait < 1e9):
            raise bad_request(f"used queue_wait_s must be a number of seconds, not {str(wait)[:40]!r}")
        return cls(lease, _count(message.get("served", 0), "used served"), None if wait is None else float(wait))

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"op": self.op, "lease": self.lease, "served": self.served}
        if self.queue_wait_s is not None:
            message["queue_wait_s"] = self.queue_wait_s
        return message


@dataclass(frozen=True)
class Warm:
    """Start workers of ``slug`` until ``replicas`` of its current version run and answer."""

    op: ClassVar[str] = "warm"
    slug: str
    replicas: int = 1
    manifests: str | None = None

    @classmethod
    def parse(cls, message: dict[str, Any]) -> Warm:
        replicas = message.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 64:
            raise bad_request(f"warm takes a replica count from 1 to 64, not {replicas!r}")
        return cls(_slug(message.get("slug")), replicas, _folder(message.get("manifests")))

    def to_message(self) -> dict[str, Any]:
        return {"op": self.op, "slug": self.slug, "replicas": self.replicas, "manifests": self.manifests}


@dataclass(frozen=True)
class StopWorkers:
    """Stop ``slug``'s workers (every provider's when None; ``slug~variant`` a variant's); leased ones finish
    first unless ``now``."""

    op: ClassVar[str] = "stop"
    slug: str | None = None
    now: bool = False

    @classmethod
    def parse(cls, message: dict[str, Any]) -> StopWorkers:
        slug = message.get("slug")
        if slug is not None and not (isinstance(slug, str) and KEY.fullmatch(slug)):
            raise bad_request(f"stop takes a provider name (or none for all), not {slug!r}")
        return cls(slug, bool(message.get("now")))

    def to_message(self) -> dict[str, Any]:
        return {"op": self.op, "slug": self.slug, "now": self.now}


@dataclass(frozen=True)
class LeaseGrant:
    """The pool's answer to ``acquire``: which worker, where its socket is, and how long a request may run."""

    lease: int
    slug: str
    replica: int
    pid: int | None
    socket: str
    cold: bool
    transcript: str | None
    request_timeout_s: float
    device: str | None = None
    version: str | None = None
    kit: dict[str, Any] | None = None
    token: str | None = None  # names the lease to its worker: a recalled one is refused there
    kept: bool = False  # the client may keep it between calls, until its worker refuses it as recalled
    priority: str = order.DEFAULT  # the class it was granted in (a class the pool may not claim is capped)
    backfilled: bool = False  # placed ahead of a waiting request: recalled after a request when that one could start

    def to_message(self) -> dict[str, Any]:
        return {"ok": True, **asdict(self)}
