"""Priority classes and the one order every waiting line keeps; standard library only, no clock, no I/O.

The pool's decision core (its per-provider replica queues and its GPU line) and the host-wide
admission service both order with these functions, so a request waits in the same place
whichever of them holds it: the higher class first, first come first served within a class,
and a waiting request ages, rising one class for every ``aging_s`` it has waited, so a
``batch`` request is never starved (with the default 300 s it ranks with ``interactive``
after 10 minutes, first come first served among them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

__all__ = ["CLASSES", "DEFAULT", "cap", "effective", "in_order", "is_class", "rank", "sort_key"]

CLASSES = ("interactive", "normal", "batch")  # the highest first
DEFAULT = "normal"
_RANK = {name: number for number, name in enumerate(CLASSES)}

T = TypeVar("T")


def is_class(value: object) -> bool:
    return isinstance(value, str) and value in _RANK


def rank(priority: str) -> int:
    """0 for ``interactive``, 1 for ``normal``, 2 for ``batch``: lower goes first."""
    return _RANK[priority]


def effective(priority: str, waited_s: float, aging_s: float) -> int:
    """The rank a request that has waited ``waited_s`` holds now: one class higher per ``aging_s`` waited
    (``aging_s`` 0: no ageing), never above the highest."""
    steps = int(max(0.0, waited_s) // aging_s) if aging_s > 0 else 0
    return max(0, _RANK[priority] - steps)


def sort_key(priority: str, arrived: float, now: float, aging_s: float) -> tuple[int, float]:
    """Where a request stands: the rank it holds now, then its arrival; the smaller goes first."""
    return (effective(priority, now - arrived, aging_s), arrived)


def in_order(items: Iterable[T], now: float, aging_s: float, priority_of: Callable[[T], str],
             arrived_of: Callable[[T], float]) -> list[T]:
    """``items`` in the order they are served: by the rank they hold now, then by arrival (FIFO)."""
    return sorted(items, key=lambda item: sort_key(priority_of(item), arrived_of(item), now, aging_s))


def cap(asked: str, allowed: Sequence[str]) -> str:
    """The class a request that asked for ``asked`` gets where only ``allowed`` may be claimed: the highest
    allowed class not above it; where none is allowed at or below it, the lowest allowed one."""
    if not allowed or asked in allowed:
        return asked
    at_or_below = [name for name in CLASSES[_RANK[asked]:] if name in allowed]
    if at_or_below:
        return at_or_below[0]
    return max((name for name in allowed if name in _RANK), key=rank)
